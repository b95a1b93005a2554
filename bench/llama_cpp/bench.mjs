// Times llama.cpp (node-llama-cpp's prebuilt CPU build) on a GGUF file: prompt processing of a
// fixed token sequence and greedy decoding, single-threaded, several repetitions. Prints one JSON
// object with the per-repetition tokens/s so that the caller can take medians.
//
// usage: node bench.mjs MODEL.gguf PROMPT_TOKENS DECODE_TOKENS REPS THREADS
import {getLlama} from "node-llama-cpp";

const [modelPath, promptN, decodeN, reps, threads] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error",
                              maxThreads: Number(threads)});
const model = await llama.loadModel({modelPath, gpuLayers: 0, useMmap: true});
const context = await model.createContext({contextSize: 1024, batchSize: 512,
                                           threads: {ideal: Number(threads), min: Number(threads)}});
// The same deterministic prompt ids pinfer's bench uses: BOS, then (i * 7919) % (vocab - 3) + 3.
const vocab = Number(model.fileInfo.tensorInfo.find(t => t.name === "token_embd.weight").dimensions[1]);
const prompt = [model.tokens.bos];
for (let i = 1; i < Number(promptN); i++) prompt.push((i * 7919) % (vocab - 3) + 3);

const promptTps = [], decodeTps = [];
for (let r = 0; r < Number(reps); r++) {
  const seq = context.getSequence();
  let t0 = performance.now();
  await seq.evaluateWithoutGeneratingNewTokens(prompt);
  let t1 = performance.now();
  promptTps.push(prompt.length / ((t1 - t0) / 1000));
  // Greedy decode: each generated token is fed back in by evaluate's generator.
  let n = 0;
  t0 = performance.now();
  for await (const token of seq.evaluate([prompt[prompt.length - 1]], {temperature: 0})) {
    if (++n >= Number(decodeN)) break;
  }
  t1 = performance.now();
  decodeTps.push(n / ((t1 - t0) / 1000));
  seq.dispose();
}
console.log(JSON.stringify({engine: "llama.cpp", model: modelPath, prompt_tokens_per_second: promptTps,
                            decode_tokens_per_second: decodeTps}));
await context.dispose();
await model.dispose();
