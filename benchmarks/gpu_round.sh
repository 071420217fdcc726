#!/usr/bin/env bash
# One round of GPU measurements, cut into commands that each fit a lent machine's 10-minute limit.
#
# Why a script: GPU machines are lent for short sessions (30 device minutes, one command at a time, no
# network), so each call must do a lot and leave its logs behind.  The stages below are the runs the
# open performance targets wait for (docs/performance.md, docs/serve.md); each writes its logs and JSON
# under $OUT (default ./gpu_out) and keeps going past a failing step, so one broken step costs no rerun.
#
#   benchmarks/gpu_round.sh prepare     # this machine, with network: wheels and headers into .whl/ (git-ignored)
#   benchmarks/gpu_round.sh selection   # GPU: DeepGEMM built in the background; top-k sweep + stage cuts; the
#                                       #      scoring tiles' sweep; the indexer kernels' GPU tests; the DeepGEMM
#                                       #      wheel kept in $OUT
#   benchmarks/gpu_round.sh forward     # GPU: two V3.2 layers at 32K, compiled, profiled (the targets' run);
#                                       #      the FP8 GEMMs' GPU tests; FP8 linears at M = 4096 and 32768,
#                                       #      the fused norm + FP8 quantisation, DeepGEMM, SwiGLU benches
#   benchmarks/gpu_round.sh serve       # GPU: the serving tests and serve_bench, production-shaped
#   benchmarks/gpu_round.sh host        # GPU host: its CPU facts; the serving idle overhead unpinned and pinned
#   benchmarks/gpu_round.sh cp2         # 2 GPUs: the CP + CUDA-graph tests (graph runner, serve)
#
# On the device, carry .whl (and nothing else is needed).  What a stage makes for the next one (the DeepGEMM
# wheel, the selection's tuning) also goes to gpu_state/ (git-ignored), which stays on a machine that is
# still warm for the next call; on a fresh machine copy them from $OUT into .whl/ instead.
set -uo pipefail
#
# REPLAY= (empty) leaves out the forward's indexer replay; FP8_LINEAR_ARGS adds options to the FP8 linears' step.
# Several stages run in one call in the order given (`gpu_round.sh selection forward`); STEPS="a b" runs only
# the steps of those names (the names the logs carry), so one call can take the part of a stage that fits.
[ $# -gt 0 ] || { echo "usage: benchmarks/gpu_round.sh prepare|selection|forward|serve|host|cp2 ..." >&2; exit 2; }
for stage in "$@"; do
    case $stage in
    prepare | selection | forward | serve | host | cp2) ;;
    *)
        echo "unknown stage $stage (prepare|selection|forward|serve|host|cp2)" >&2
        exit 2
        ;;
    esac
done
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
WHL=.whl
STATE=gpu_state
mkdir -p "$OUT" "$STATE"
# PyPI's file of deepinfer-gemm 2.8.2 (an sdist only: it is built on the GPU machine, against its torch)
DEEP_GEMM_SDIST=https://files.pythonhosted.org/packages/c3/81/8211cfa3e92b0f5be337116fe15da8a6fa232161899a628fe100d8895fa0/deepinfer_gemm-2.8.2.tar.gz
SITE=/tmp/cpgraph_site
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {  # step NAME CMD...: run, log to $OUT/NAME.log, report the status, go on (skipped if STEPS leaves it out)
    local name=$1
    shift
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        echo "== $name: skipped (STEPS)"
        return 0
    fi
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    tail -n 25 "$OUT/$name.log"
    return 0
}

install_wheels() {  # once per call, whatever the number of stages
    [ -n "${WHEELS_DONE:-}" ] && return 0
    WHEELS_DONE=1
    mkdir -p "$SITE"
    local wheels=($WHL/*.whl $STATE/*.whl)
    wheels=($(ls "${wheels[@]}" 2>/dev/null))
    if [ ${#wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" || echo "wheel install failed"
    fi
    export PYTHONPATH=$SITE:$PWD
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
}

build_deep_gemm() {  # in the background; the wheel lands in $OUT (and the site) when done
    if python3 -c 'import deep_gemm' 2>/dev/null || [ ! -f $WHL/deepinfer_gemm-2.8.2.tar.gz ]; then
        return 0
    fi
    (CPATH=$PWD/$WHL/elfinc/usr/include CUDA_HOME=/usr/local/cuda CXX=/usr/bin/g++ CC=/usr/bin/gcc MAX_JOBS=12 \
        python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/dg $WHL/deepinfer_gemm-2.8.2.tar.gz \
        && cp /tmp/dg/deepgemm-*.whl "$OUT"/ && cp /tmp/dg/deepgemm-*.whl "$STATE"/ \
        && python3 -m pip install -q --no-index --no-deps --target "$SITE" /tmp/dg/deepgemm-*.whl) \
        >"$OUT/deep_gemm_build.log" 2>&1 &
    DG_PID=$!
}

guard_new_kernels() {  # each new kernel's GPU tests; a failing one's op goes to CPGRAPH_PROVIDERS=op:reference
    local pair file op rc fallback=()
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" forward_32k "* ]]; then return 0; fi
    # GUARD="file:op ..." names the pairs (default: the kernels built without a device in the last rounds)
    for pair in ${GUARD:-tests/ops/test_moe_route.py:moe_route tests/ops/test_mla_output.py:mla_output \
        tests/kernels/test_index_quant.py:indexer_q_prepare tests/ops/test_norm_quant.py:fp8_rms_norm_quantize}; do
        file=${pair%%:*}
        op=${pair##*:}
        python3 -m pytest -q -x "$file" -p no:cacheprovider >"/tmp/guard_$op.log" 2>&1
        rc=$?
        echo "guard: $file exit $rc"
        if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
            cp "/tmp/guard_$op.log" "$OUT/"  # only a failure's log comes back (a lent machine returns few files)
            fallback+=("$op:reference")
            echo "guard: $file failed (exit $rc): $op runs its torch reference in this call"
            tail -n 15 "/tmp/guard_$op.log"
        fi
    done
    if [ ${#fallback[@]} -gt 0 ]; then
        local joined
        joined=$(IFS=,; echo "${fallback[*]}")
        export CPGRAPH_PROVIDERS=${CPGRAPH_PROVIDERS:+$CPGRAPH_PROVIDERS,}$joined
        echo "guard: CPGRAPH_PROVIDERS=$CPGRAPH_PROVIDERS"
    fi
}

run_stage() {
case $1 in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    mkdir -p $WHL
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $WHL sgl-flash-mla==1.0.0 expecttest
    [ -f $WHL/deepinfer_gemm-2.8.2.tar.gz ] || curl -sSfL -o $WHL/deepinfer_gemm-2.8.2.tar.gz "$DEEP_GEMM_SDIST" \
        || echo "DeepGEMM sdist: download it by hand (docs/kernels.md)"
    (cd /tmp && apt-get download libdw-dev libelf-dev) && mkdir -p $WHL/elfinc \
        && for deb in /tmp/libdw-dev_*.deb /tmp/libelf-dev_*.deb; do dpkg -x "$deb" $WHL/elfinc; done
    du -sh $WHL
    ;;
selection)
    install_wheels
    build_deep_gemm
    step topk_sweep python3 benchmarks/topk_select_bench.py --sweep --stages --json "$OUT/topk.json" \
        --write-tuning "$OUT/tuning.json"
    cp "$OUT/tuning.json" "$STATE/tuning.json" 2>/dev/null
    # The scoring tiles (bf16 and FP8 keys) at the forward's 1 GiB score budget: the sweep alone
    step score_sweep python3 benchmarks/indexer_bench.py --sweep --fp8 --shapes "" --budget 1073741824 \
        --tuning-out "$OUT/score_tuning.json"
    step indexer_gpu_tests python3 -m pytest -q -m gpu tests/kernels/test_indexer_kernels.py -p no:cacheprovider
    step sass_loops python3 benchmarks/sass_loops.py
    if [ -n "${DG_PID:-}" ]; then wait "$DG_PID"; echo "DeepGEMM build: exit $?"; tail -n 5 "$OUT/deep_gemm_build.log"; fi
    ;;
forward)
    install_wheels
    TUNE=()
    for t in $STATE/tuning.json $WHL/tuning.json; do
        [ -f "$t" ] && { TUNE=(env CPGRAPH_INDEXER_TUNING=$PWD/$t); echo "selection tuning: $t"; break; }
    done
    # First the GPU tests of the kernels the forward now runs (a kernel that fails here would fail the forward;
    # CPGRAPH_PROVIDERS=op:reference forces an op's torch reference meanwhile), then the forward, then the
    # dense FP8 linears' target at M = 4096 (and 32768 beside it), DeepGEMM's kernels and the fused SwiGLU
    # (their GPU tests are gated by needs_gpu, not the gpu marker: the whole files, CPU cases included)
    step fp8_gpu_tests python3 -m pytest -q tests/kernels/test_deep_gemm_experts.py tests/ops/test_fp8_linear.py \
        tests/ops/test_norm_quant.py tests/passes/test_fuse_norm_quant.py -p no:cacheprovider
    # A kernel built without a device whose GPU tests fail runs as its torch reference in the forward (and the log
    # says so), so one broken kernel does not cost the forward's figures
    guard_new_kernels
    # --replay: the indexer's first call replayed on its own arguments, rested and right after a forward, with the
    # clocks of each window (is the FP8 scoring's loss in the forward its inputs or the GPU's state?)
    step forward_32k "${TUNE[@]}" python3 benchmarks/production_shape.py --cases 32K \
        --variants bf16/bf16,bf16/fp8,fp8/fp8 --modes compiled --profile ${REPLAY---replay indexer_topk} \
        --json "$OUT/production_32k.json"
    # Device time (CUDA-graph replays: eager calls add ~60 us of host time at 4096 rows)
    # (FP8_LINEAR_ARGS narrows it, e.g. "--shapes q_a_kv_a --groups attn_input": the last option of a name wins)
    step fp8_linears python3 benchmarks/fp8_linear_bench.py --rows 4096,32768 --graph --check \
        --json "$OUT/fp8_linear.json" ${FP8_LINEAR_ARGS:-}
    # The add + RMSNorm that quantises for the FP8 projections, against Inductor's norm + the quantiser
    step norm_quant python3 benchmarks/norm_quant_bench.py --sweep --graph --json "$OUT/norm_quant.json"
    # The router's selection in one kernel, against the three topk calls it replaced (eager and Inductor)
    step moe_route python3 benchmarks/moe_route_bench.py --sweep --graph --json "$OUT/moe_route.json"
    # The FP8 indexer's operand kernels, the queries' rotation and quantisation fused (indexer_q_prepare) among them
    step index_quant python3 benchmarks/index_quant_bench.py --sweep --json "$OUT/index_quant.json"
    # The W_UV absorption written as o_proj's rows (cpgraph::mla_output) against einsum + reshape under Inductor
    step mla_bench python3 benchmarks/mla_query_bench.py --rows 32768 --json "$OUT/mla_query.json"
    step deep_gemm python3 benchmarks/deep_gemm_bench.py --json "$OUT/deep_gemm.json"
    step swiglu python3 benchmarks/swiglu_bench.py --json "$OUT/swiglu.json"
    ;;
serve)
    install_wheels
    step serve_gpu_tests python3 -m pytest -q -m gpu tests/serve tests/runtime/test_graph_runner.py -p no:cacheprovider
    step serve_bench_production python3 benchmarks/serve_bench.py --device cuda --model production \
        --backend inductor --cuda-graphs --page 64 --num-pages 4096 --token-budget 4096 --requests 64 --idle 8 \
        --rates 0.8 --out "$OUT/serve_production.json"
    ;;
host)
    # The serving host's own latencies (no GPU work to speak of): the idle overhead's floor is the host's thread
    # wake-ups and loopback round trips, which differ by machine (docs/serve.md).  The idle phase with the tiny
    # model on the GPU, unpinned and with the whole process (its client process included) on one and two CPUs.
    install_wheels
    step host_facts bash -c 'nproc; lscpu | head -20; systemd-detect-virt 2>/dev/null; for f in \
        /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor; do \
        echo "$f: $(cat $f 2>/dev/null)"; done'
    # And unpinned with the idle fast path off (--engine-thread-only): what the step on the event loop saves here.
    for cpus in all 2 2,3 all_engine_thread; do
        pin=() mode=()
        case $cpus in
        all) ;;
        all_engine_thread) mode=(--engine-thread-only) ;;
        *) pin=(python3 -c 'import os, sys; os.sched_setaffinity(0, {int(c) for c in \
            sys.argv[1].split(",")}); os.execvp(sys.argv[2], sys.argv[2:])' "$cpus") ;;
        esac
        step "host_idle_cpus_${cpus/,/_}" "${pin[@]}" python3 benchmarks/serve_bench.py --device cuda --model tiny \
            --system-len 64 256 --suffix-len 8 128 --requests 64 --token-budget 512 --idle 40 --idle-only \
            "${mode[@]}" --out "$OUT/host_idle_${cpus/,/_}.json"
    done
    ;;
cp2)
    install_wheels
    step cp2_tests python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/serve/test_serve_gpu.py::test_cp2_cuda_graph_server_replays_and_matches_prefill_logits \
        tests/runtime/test_bucket_padding_cp.py::test_cuda_capture_pads_a_cached_prefix_under_cp
    step cp2_run_graphs python3 -m cpgraph run --model tiny-glm5 --cp 2 --device cuda \
        --cache --cuda-graphs --json "$OUT/cp2_run_graphs.json"
    ;;
esac
}

# A lent machine returns at most 8 files from $OUT: past that, everything goes into one archive (the logs' tails
# are in the call's output already), so no JSON is left behind.  Also on SIGTERM / SIGINT (`timeout N
# gpu_round.sh ...` stopping a call before the machine's own limit): a call cut short keeps what it measured.
pack_out() {
    local files
    files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    if [ "$files" -gt 8 ]; then  # an archive of an earlier pack goes into the new one
        (cd "$OUT" && tar czf round.tgz.new --exclude=round.tgz.new ./* \
            && find . -maxdepth 1 -type f ! -name round.tgz.new -delete && mv round.tgz.new round.tgz) \
            && echo "== $files files packed into $OUT/round.tgz"
    fi
}
trap 'echo "== stopped by a signal: packing what was measured"; pack_out; exit 124' TERM INT

for stage in "$@"; do
    run_stage "$stage"
done
pack_out
