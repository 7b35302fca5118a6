set -u
P() { echo "$@" | tee -a $OUT/progress.txt; }
P "== build $(date +%T)"
[ -d /tmp/m1b ] || python3 -m trio_mlx.cli model build --shape llama-3.2-1b --dtype bfloat16 /tmp/m1b > /dev/null 2>&1
for schema in array string; do
  P "== grammar $schema $(date +%T)"
  timeout ${TG:-170} python3 benchmarks/probes/probe_grammar_engine.py /tmp/m1b 64 256 2 $schema > $OUT/grammar-$schema.txt 2>&1; P "rc=$?"
  grep -E "fair|full width|old figure|x of free|round" $OUT/grammar-$schema.txt | tail -12 | tee -a $OUT/progress.txt
done
P "== random c=4 $(date +%T)"
bash .gpuwork/g1a.sh
P "== done $(date +%T)"
