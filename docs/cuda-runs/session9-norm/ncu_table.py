import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[12] == 'gpu__time_duration.sum']
for r in rows[-int(sys.argv[2]):]:
    print(f"{r[4].split('(')[0][-40:]:40s} {r[8]:>14s} {r[14]:>8s}")
