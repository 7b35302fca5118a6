set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
P "== build $(date +%T)"
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
KV() { grep '^{' $1 | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d['kv_bits'], 'c=%d' % d['c'], 'row %.0f' % d['decode_tps_per_row'], 'total', d['decode_tps_total'] and round(d['decode_tps_total']), 'B/tok', d['kv_bytes_per_token'], 'fit32k', d['fit_32k'], 'ttft %.3f' % d['ttft_median'], d['errors'][:1])
"; }
P "== kv g64 round 1 $(date +%T)"
timeout 200 python3 benchmarks/probes/probe_kv_bits.py /tmp/m1b --configs none,8,4 --levels 1,16 --group-size 64 --out $OUT/kv64-r1.json > $OUT/kv64-r1.txt 2>&1; echo "rc=$?" >> $OUT/kv64-r1.txt
KV $OUT/kv64-r1.txt | tee -a $OUT/progress.txt; grep -E "Error|rc=" $OUT/kv64-r1.txt | tail -2 | cut -c1-300 | tee -a $OUT/progress.txt
P "== kv g64 round 2 $(date +%T)"
timeout 170 python3 benchmarks/probes/probe_kv_bits.py /tmp/m1b --configs 4,8,none --levels 1,16 --group-size 64 --out $OUT/kv64-r2.json > $OUT/kv64-r2.txt 2>&1; echo "rc=$?" >> $OUT/kv64-r2.txt
KV $OUT/kv64-r2.txt | tee -a $OUT/progress.txt; grep -E "Error|rc=" $OUT/kv64-r2.txt | tail -2 | cut -c1-300 | tee -a $OUT/progress.txt
P "== done $(date +%T)"
