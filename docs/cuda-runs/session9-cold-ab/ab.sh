#!/bin/bash
# Scratch: the helper's same-process A/B of the CPU sparse token (original vs new code in one
# binary), one thread, on the H200's host.
sdk=$(realpath .device/sdk)
while read -r file soname devname; do
  ln -sf "$file" "$sdk/usr/lib/x86_64-linux-gnu/$soname"; ln -sf "$file" "$sdk/usr/lib/x86_64-linux-gnu/$devname"
done < "$sdk/links.txt"
export LD_LIBRARY_PATH=$sdk/usr/lib/x86_64-linux-gnu
grep -m1 'model name' /proc/cpuinfo
for a in "Q4_0 9" "Q8_0 5" "F16 3"; do timeout 150 .device/final_ab $a 0 1 2>&1 | tail -4; done
