#!/usr/bin/env bash
# Serving overhead on E1: how much output throughput `tilellm serve` loses against the offline
# engine on the same work (docs/workloads.md, "Serving"), in one call:
#   1. offline: `tilellm bench throughput --workloads E1` (random Qwen3-0.6B weights, bf16, ignore EOS);
#   2. `tilellm serve` on the same config-only model directory with the same engine flags
#      (`--load-format dummy --skip-tokenizer-init`, so no detokenization, as offline), on 127.0.0.1;
#      the engine runs in its own process (the default; SERVE_ARGS=--no-engine-process for the
#      thread), which logs its per-step host and device-wait times to server.log when it stops;
#   3. `tilellm bench serve` over the same 256 E1 requests (token-id prompts, streamed, ignore_eos,
#      temperature 0.6) at each rate of $RATES (default: inf 64 16 requests/s; inf sends them all at
#      once: the saturation figure). Each run shifts the prompt ids (--prompt-id-offset) so that no
#      run finds an earlier run's prompts in the prefix cache; the CPU time of the HTTP process and
#      of the engine process during each run says which of the two bounds it;
#   4. SIGTERM to the server, then a table: output tok/s per run and the serving overhead
#      1 - (server output tok/s at rate inf) / (offline E1 output tok/s); target < 10%.
#   5. the plainest client (benchmarks/plain_client.py: one asyncio + httpx client, every request at
#      once, not streamed) at each httpx connection limit of $PLAIN_CONNECTIONS (default: 0 = none,
#      and 100 = httpx's default), then streamed without a limit from each count of client processes
#      in $PLAIN_STREAM_CLIENTS (default: 1 4; one client process reading 256 streams is bound by its
#      own CPU, several measure the server). Around each, two scrapes of /metrics give the engine's
#      steps in the run and their time per step by phase (schedule, prepare and launch, waiting for
#      the step's tokens, postprocess: the engine_step_* counters), the engine's busy time (from the
#      first admission to the last step: engine_busy_seconds) and its steps' device time (CUDA
#      events: the server runs with TILELLM_TIME_DEVICE=1), so that a run's wall time splits into
#      the client's and the HTTP path's edges, the loop around the steps, and device idle time.
# Files in $OUT (8): offline_e1.json/.log, server.log, bench_serve.log, plain_client.log, serve.json
# (every run + offline), metrics.txt (the server's /metrics after the runs), summary.txt.
#
# Usage: bash benchmarks/serve_overhead.sh   (about 2 minutes on an H200 with RATES=inf)
# CPU dry run: SCALE=0.02 DEVICE=cpu bash benchmarks/serve_overhead.sh
#
# The server's dependencies (fastapi, starlette, uvicorn, pydantic) come with `pip install -e .`.
# On a GPU machine whose Python lacks them and cannot download, put their wheels in .whl/ (ignored
# by git) and copy it with the checkout: the script installs them into /tmp/site. Fetched elsewhere,
# in the repository root, with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 \
#     pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0 \
#     h11==0.16.0 click==8.5.1 annotated-doc==0.0.7 opentelemetry-api==1.45.2 anyio==4.16.0 \
#     httptools==0.9.0
# (opentelemetry-api: fastapi 0.165 imports it; httptools: uvicorn's fast HTTP parser.)
#
# Knobs: SCALE (1 = E1; shrinks lengths and count as `bench throughput --scale`), DEVICE, DTYPE
# (bfloat16), RATES, CLIENTS (client process counts run at each rate, `--num-clients`; default 1),
# MAX_BATCHED (16384: --max-num-batched-tokens of both), PORT (8011), BUDGET_S (470: the whole
# script; each step gets at most what is left), OUT (./artifacts/serve),
# SERVE_ARGS / THROUGHPUT_ARGS / BENCH_ARGS (extra flags), SKIP_OFFLINE=1.
set -uo pipefail
START=$SECONDS
BUDGET_S=${BUDGET_S:-470}
OUT=${OUT:-./artifacts/serve}
SCALE=${SCALE:-1}
DEVICE=${DEVICE:-}
DTYPE=${DTYPE:-bfloat16}
RATES=${RATES-inf 64 16}  # (empty: no `bench serve` runs)
PLAIN_CONNECTIONS=${PLAIN_CONNECTIONS-0 100}
PLAIN_STREAM_CLIENTS=${PLAIN_STREAM_CLIENTS-1 4}
CLIENTS=${CLIENTS:-1}
MAX_BATCHED=${MAX_BATCHED:-16384}  # the same token budget offline and served
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
WORK=$(mktemp -d /tmp/tilellm-serve.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
DEV_ARGS=()
[ -n "$DEVICE" ] && DEV_ARGS=(--device "$DEVICE")
SERVER_PID=

step() { echo; echo "=== [$(date +%T) +$((SECONDS - START))s] $*"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# limit SECONDS: the smaller of SECONDS and the budget left minus a reserve for stopping the server
limit() { local l=$(($(left) - 25)); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo $l; }  # never 0: `timeout 0` means none
stop_server() {
  [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null || return 0
  step "stopping the server (SIGTERM to pid $SERVER_PID)"
  kill -TERM "$SERVER_PID"
  for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "server still running after 20 s: SIGKILL"; kill -KILL "$SERVER_PID"
  fi
  wait "$SERVER_PID"; echo "server exit status: $?"
  SERVER_PID=
}
trap stop_server EXIT

step "python packages"
if python3 -c "import fastapi, uvicorn, pydantic, starlette" 2>/dev/null; then
  echo "fastapi/uvicorn/pydantic/starlette import already: no wheel install"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  ls .whl/*.whl >/dev/null 2>&1 || { echo "FAIL: fastapi is missing: pip install -e . (or put its wheels in .whl/, see above)" >&2; exit 1; }
  rm -rf /tmp/site
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "FAIL: wheel install"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
timeout 60 python3 -c "
import importlib.util as u, fastapi, pydantic, starlette, uvicorn, torch
print('fastapi', fastapi.__version__, 'starlette', starlette.__version__, 'uvicorn', uvicorn.__version__,
      'pydantic', pydantic.__version__, 'torch', torch.__version__,
      '| uvloop:', bool(u.find_spec('uvloop')), 'httptools:', bool(u.find_spec('httptools')))
import tilellm.server.app  # noqa: the server's imports work
" || { echo "FAIL: server imports"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv

step "model directory: Qwen3-0.6B config only (load_format=dummy), SCALE=$SCALE"
MODEL=$WORK/qwen3-0.6b-dummy
MAX_MODEL_LEN=$(timeout 120 python3 -c "
from tilellm.bench.throughput import e1
from tilellm.testing import QWEN3_0_6B_CONFIG, make_random_model_dir
make_random_model_dir('$MODEL', QWEN3_0_6B_CONFIG)
w = e1($SCALE)
print(max(map(len, w.prompts)) + max(w.max_tokens))  # what bench throughput uses for E1
") || { echo "FAIL: model directory"; exit 1; }
echo "model: $MODEL; max_model_len: $MAX_MODEL_LEN"

if [ "${SKIP_OFFLINE:-0}" != 1 ]; then
  step "offline E1: tilellm bench throughput --workloads E1 (limit $(limit 240) s)"
  timeout -k 10 "$(limit 240)" python3 -m tilellm.cli bench throughput --workloads E1 --scale "$SCALE" \
    --max-num-batched-tokens "$MAX_BATCHED" --dtype "$DTYPE" "${DEV_ARGS[@]}" ${THROUGHPUT_ARGS:-} --json "$OUT/offline_e1.json" \
    >"$OUT/offline_e1.log" 2>&1
  echo "exit status: $?"
  tr '\r' '\n' <"$OUT/offline_e1.log" | grep -v -e "Processed prompts" -e '^\s*$' | tail -n 12 | cut -c1-400
fi

step "starting tilellm serve on $URL"
TILELLM_TIME_DEVICE=1 timeout -k 10 "$(limit 400)" python3 -m tilellm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --load-format dummy --skip-tokenizer-init --served-model-name qwen3-0.6b-dummy --dtype "$DTYPE" \
  --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens "$MAX_BATCHED" \
  --uvicorn-log-level warning --disable-uvicorn-access-log "${DEV_ARGS[@]}" ${SERVE_ARGS:-} \
  >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
HEALTH_LIMIT=$(limit 240)
healthy=0
while [ $((SECONDS - START)) -lt $((BUDGET_S - 25)) ] && [ "$HEALTH_LIMIT" -gt 0 ]; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "FAIL: the server exited:"; tail -n 30 "$OUT/server.log"; break; fi
  if python3 -c "
import sys, urllib.request
try:
    sys.exit(urllib.request.urlopen('$URL/health', timeout=2).status != 200)
except Exception:
    sys.exit(1)
"; then healthy=1; break; fi
  sleep 1
  HEALTH_LIMIT=$((HEALTH_LIMIT - 1))
done
if [ $healthy = 1 ]; then
  echo "healthy after $((SECONDS - START))s of the script"
else
  echo "FAIL: the server did not become healthy"; tail -n 30 "$OUT/server.log"
fi

cpu_ticks() {  # cpu_ticks PID: user + system clock ticks of that process so far (0 if gone)
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] && awk '{print $14 + $15}' "/proc/$1/stat" || echo 0
}
bench() {  # bench LIMIT_S ARGS...: one `tilellm bench serve` run, output appended to bench_serve.log
  local lim; lim=$(limit "$1"); shift
  if [ "$lim" -lt 10 ]; then echo "SKIPPED: no time left in the budget"; return 1; fi
  # The HTTP process (child of `timeout`) and the engine process (its spawned child): how busy
  # each was during the run says which one bounds the served throughput.
  local http eng h0 e0 t0 hz; http=$(pgrep -P "$SERVER_PID" | head -1); eng=$(pgrep -P "$http" -f spawn_main | head -1)
  h0=$(cpu_ticks "$http"); e0=$(cpu_ticks "$eng"); t0=$(date +%s.%N); hz=$(getconf CLK_TCK)
  timeout -k 5 "$lim" python3 -m tilellm.cli bench serve --base-url "$URL" --scale "$SCALE" \
    ${BENCH_ARGS:-} "$@" 2>&1 | tee -a "$OUT/bench_serve.log"
  local rc=${PIPESTATUS[0]}
  python3 -c "
w = $(date +%s.%N) - $t0
h, e = ($(cpu_ticks "$http") - $h0) / $hz, ($(cpu_ticks "$eng") - $e0) / $hz
print(f'process CPU over {w:.1f} s: HTTP process (pid $http) {h:.1f} s = {100 * h / w:.0f}% of a core; '
      f'engine process (pid $eng) {e:.1f} s = {100 * e / w:.0f}%')" | tee -a "$OUT/bench_serve.log"
  echo "exit status: $rc"
  return $rc
}

scrape() {  # scrape FILE: the server's /metrics now
  timeout 10 python3 -c "
import urllib.request
open('$1', 'w').write(urllib.request.urlopen('$URL/metrics', timeout=5).read().decode())" || : >"$1"
}
step_times() {  # step_times BEFORE AFTER: the engine's steps between two scrapes, ms a step by phase
  python3 - "$1" "$2" <<'PY'
import re, sys

def read(path):
    values = {}
    for line in open(path):
        m = re.match(r"tilellm:(engine_\w*_total)\{[^}]*\} (\S+)", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values

before, after = read(sys.argv[1]), read(sys.argv[2])
steps = after.get("engine_steps_total", 0) - before.get("engine_steps_total", 0)
if steps <= 0:
    print("engine steps: not in /metrics")
else:
    phases = ("schedule", "prepare", "execute", "postprocess")
    ms = {p: 1e3 * (after[f"engine_step_{p}_seconds_total"] - before[f"engine_step_{p}_seconds_total"]) / steps
          for p in phases}
    print(f"engine steps in the run: {steps:.0f}; per step: " + ", ".join(f"{p} {ms[p]:.2f} ms" for p in phases)
          + f"; sum {sum(ms.values()):.2f} ms")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("engine_busy_seconds_total", "engine_step_device_seconds_total")}
    busy, device = delta["engine_busy_seconds_total"], delta["engine_step_device_seconds_total"]
    in_steps = sum(ms.values()) * steps / 1e3
    print(f"engine busy (first admission to last step) {busy:.3f} s, in its steps {in_steps:.3f} s; "
          + (f"device {device:.3f} s (idle {busy - device:.3f} s of the busy time)" if device else "device: not timed"))
PY
}

if [ $healthy = 1 ]; then
  step "warm-up: 32 E1 prompts (ids shifted), 4 output tokens each"
  bench 120 --num-prompts 32 --output-len 4 --prompt-id-offset 5000 >/dev/null
  i=0
  for rate in $RATES; do
    for clients in $CLIENTS; do
      i=$((i + 1))
      step "bench serve: rate $rate req/s, $clients client process(es), E1 workload (prompt ids +$i)"
      bench 150 --request-rate "$rate" --num-clients "$clients" --prompt-id-offset "$i" \
        --json "$WORK/serve_${i}_rate_${rate}.json"
    done
  done
  # The plainest client (benchmarks/plain_client.py): one asyncio + httpx client, every request at
  # once, not streamed, at each connection limit of $PLAIN_CONNECTIONS (0: none; 100 is httpx's
  # default), then streamed without a limit from each count of client processes in $PLAIN_STREAM_CLIENTS.
  plain_runs=($PLAIN_CONNECTIONS)
  for k in $PLAIN_STREAM_CLIENTS; do plain_runs+=("stream$k"); done
  for conn in ${plain_runs[@]+"${plain_runs[@]}"}; do
    i=$((i + 1))
    lim=$(limit 150)
    if [ "$lim" -lt 10 ]; then echo "SKIPPED: no time left in the budget"; break; fi
    if [[ "$conn" == stream* ]]; then args=(--stream --num-clients "${conn#stream}"); else args=(--max-connections "$conn"); fi
    step "plain client: ${args[*]} (prompt ids +$i)"
    http=$(pgrep -P "$SERVER_PID" | head -1); eng=$(pgrep -P "$http" -f spawn_main | head -1)
    scrape "$WORK/metrics_before_$i.txt"
    h0=$(cpu_ticks "$http"); e0=$(cpu_ticks "$eng"); t0=$(date +%s.%N); hz=$(getconf CLK_TCK)
    timeout -k 5 "$lim" python3 benchmarks/plain_client.py --base-url "$URL" --scale "$SCALE" \
      --prompt-id-offset "$i" "${args[@]}" --json "$WORK/plain_${i}.json" 2>&1 | tee -a "$OUT/plain_client.log"
    python3 -c "
w = $(date +%s.%N) - $t0
h, e = ($(cpu_ticks "$http") - $h0) / $hz, ($(cpu_ticks "$eng") - $e0) / $hz
print(f'process CPU over {w:.1f} s: HTTP process {h:.1f} s = {100 * h / w:.0f}% of a core; '
      f'engine process {e:.1f} s = {100 * e / w:.0f}%')" | tee -a "$OUT/plain_client.log"
    scrape "$WORK/metrics_after_$i.txt"
    step_times "$WORK/metrics_before_$i.txt" "$WORK/metrics_after_$i.txt" | tee -a "$OUT/plain_client.log"
  done
  timeout 10 python3 -c "
import urllib.request
open('$OUT/metrics.txt', 'w').write(urllib.request.urlopen('$URL/metrics', timeout=5).read().decode())
" && grep -E "^tilellm:(prefix_cache_(hits|queries)_total|num_preemptions_total|generation_tokens_total)" "$OUT/metrics.txt"
fi
stop_server

step "summary"
timeout 30 python3 - "$OUT" "$WORK" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, math, os, re, sys

out, work = sys.argv[1], sys.argv[2]
offline = None
path = os.path.join(out, "offline_e1.json")
if os.path.isfile(path):
    offline = json.load(open(path))["results"][0]
runs = []
for f in sorted(glob.glob(os.path.join(work, "serve_*_rate_*.json")),
                key=lambda f: int(re.search(r"serve_(\d+)_", f).group(1))):
    runs.append(json.load(open(f)))

def num(v, fmt):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

base = offline["output_tok_s"] if offline else None
head = (f"{'run':16} {'cl':>2} {'reqs':>5} {'failed':>6} {'out tokens':>10} {'sec':>7} {'out tok/s':>10} "
        f"{'% offline':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8}")
print(head)
print("-" * len(head))
if offline:
    print(f"{'offline E1':16} {'-':>2} {offline['requests']:>5} {'-':>6} {offline['output_tokens']:>10} "
          f"{offline['seconds']:>7.2f} {base:>10,.0f} {100.0:>8.1f}% "
          f"{num(offline['ttft_p50_s'] and 1000 * offline['ttft_p50_s'], '>9.0f')} "
          f"{num(offline['ttft_p99_s'] and 1000 * offline['ttft_p99_s'], '>9.0f')} {'-':>9} {'-':>8}")
plain = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(work, "plain_*.json")),
                                             key=lambda f: int(re.search(r"plain_(\d+)", f).group(1)))]
json.dump({"offline_e1": offline, "serve": runs, "plain_client": plain},
          open(os.path.join(out, "serve.json"), "w"), indent=2)
for r in runs:
    share = f"{100 * r['output_throughput'] / base:>8.1f}%" if base else f"{'-':>9}"
    rate = r["request_rate"] if r["request_rate"] == "inf" else format(r["request_rate"], "g")
    print(f"{'serve rate=' + rate:16} {r.get('num_clients', 1):>2} {r['completed']:>5} {r['failed']:>6} "
          f"{r['total_output_tokens']:>10} {r['duration_s']:>7.2f} {r['output_throughput']:>10,.0f} "
          f"{share} {num(r['p50_ttft_ms'], '>9.0f')} {num(r['p99_ttft_ms'], '>9.0f')} "
          f"{num(r['p50_tpot_ms'], '>9.2f')} {num(r['p99_itl_ms'], '>8.1f')}")
print("(latencies in ms; offline TTFT counts from the start of the whole batch)")
sat = [r for r in runs if r["request_rate"] == "inf" and r["failed"] == 0]
if base and sat:
    best = max(r["output_throughput"] for r in sat)
    print(f"serving overhead at saturation (rate inf, best of {len(sat)}): "
          f"{100 * (1 - best / base):.1f}% (server {best:,.0f} vs offline {base:,.0f} output tok/s; "
          f"target < 10%)")
else:
    print("serving overhead: not computed (missing the offline result or a clean rate-inf run)")
for r in plain:
    mode = "streamed" if r["stream"] else "not streamed"
    mode += f", {r.get('num_clients', 1)} client process(es)"
    share = f"{100 * r['output_tok_s'] / base:.1f}% of offline" if base else ""
    print(f"plain client, {mode}, max_connections {r['max_connections'] or 'none'}: "
          f"{r['output_tok_s']:,.0f} output tok/s ({r['output_tokens']} tokens, {r['seconds']:.2f} s) {share}; "
          f"client CPU {r.get('client_cpu_s', float('nan')):.2f} s, last request sent at "
          f"{r.get('last_request_sent_s') or float('nan'):.3f} s")
for r in runs:
    if r["failed"]:
        print(f"rate {r['request_rate']}: {r['failed']} failed: {r['errors'][:3]}")
EOF
rm -rf "$WORK"
echo "done in $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
