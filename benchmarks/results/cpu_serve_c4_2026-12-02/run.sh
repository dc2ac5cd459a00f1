#!/bin/bash
set -x
cd /work/main
for cfg in default none; do
  port=$([ $cfg = default ] && echo 8130 || echo 8131)
  extra=$([ $cfg = none ] && echo "--draft none")
  blockspec serve --device cpu --port $port $extra > /tmp/cpu_serve2/server_$cfg.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  blockspec bench serve --base-url http://127.0.0.1:$port --concurrency 4 --num-prompts 32 \
      --dataset benchmarks/prompts/code.jsonl --output-len 128 --ignore-eos --label "demo $cfg" \
      --out /tmp/cpu_serve2/serve_$cfg.json > /tmp/cpu_serve2/bench_$cfg.log 2>&1
  kill $pid; wait $pid
done
echo done
