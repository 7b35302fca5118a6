set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
P "== build $(date +%T)"
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
for r in 1 2; do
  if [ $r = 1 ]; then cfg=none,8,4; else cfg=4,8,none; fi
  P "== kv g64 round $r ($cfg) $(date +%T)"
  timeout 170 python3 benchmarks/probes/probe_kv_bits.py /tmp/m1b --configs $cfg --levels 1,16 --group-size 64 --out $OUT/kv64-r$r.json > $OUT/kv64-r$r.txt 2>&1; echo "rc=$?" >> $OUT/kv64-r$r.txt
  grep '^{' $OUT/kv64-r$r.txt | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d['kv_bits'], 'c=%d' % d['c'], 'row %.0f' % d['decode_tps_per_row'], 'total', d['decode_tps_total'] and round(d['decode_tps_total']), 'B/tok', d['kv_bytes_per_token'], 'fit32k', d['fit_32k'], 'ttft %.3f' % d['ttft_median'], d['errors'][:1])
" | tee -a $OUT/progress.txt; tail -2 $OUT/kv64-r$r.txt | tee -a $OUT/progress.txt
done
P "== kv g32 $(date +%T)"
timeout 100 python3 benchmarks/probes/probe_kv_bits.py /tmp/m1b --configs 8,4 --levels 1 --group-size 32 --out $OUT/kv32.json > $OUT/kv32.txt 2>&1; echo "rc=$?" >> $OUT/kv32.txt; grep '^{' $OUT/kv32.txt | cut -c1-200 | tee -a $OUT/progress.txt; tail -2 $OUT/kv32.txt | tee -a $OUT/progress.txt
P "== adapters $(date +%T)"
timeout 240 python3 benchmarks/probes/probe_adapters.py /tmp/m1b --levels 1,16 --rounds 2 --out $OUT/adapters.json > $OUT/adapters.txt 2>&1; echo "rc=$?" >> $OUT/adapters.txt; grep -v '^\[' $OUT/adapters.txt | tail -20 | tee -a $OUT/progress.txt
P "== done $(date +%T)"
