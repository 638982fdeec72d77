#!/usr/bin/env bash
# One-command check of this project on one CUDA GPU (at most 6 minutes; GPU_CHECK_DEADLINE_S):
#   1. device facts (torch, CUDA, NCCL, cuDNN, the GPU, a bf16 matmul's TFLOP/s);
#   2. the gpu-marked tests (offload page-locking, CUDA-event traces, mixed precision on NCCL);
#   3. gpt_small at pp=1 in fp32, bf16 and fp16 through `python -m launcher` (step time, tokens/s,
#      MFU, peak memory from each run's summary.json);
#   4. schedule=harmony_pp on one GPU and 4 fused models (train.models=4);
#   5. bf16 features: compiled layers (train.compile), selective recomputation, a 0.1B Llama, a wider
#      GPT, harmony_pp in bf16, and one model alone as the baseline of the 4 fused ones.
# Every step is guarded: a failure is recorded (exit code, the end of its output) and the next one
# runs. The report (gpu_check.md, gpu_check.json and gpu_check.log, every step's output) goes to
# $OUT when set, else to runs/gpu_check/.
#
#   scripts/gpu_check.sh                 # run everything (needs CUDA)
#   scripts/gpu_check.sh --dry-run       # print the commands, write the report with nothing run
#   scripts/gpu_check.sh --wheels DIR    # first install the wheels in DIR (hydra-core, omegaconf,
#                                        # antlr4) into a private folder put on PYTHONPATH
#
# Environment: PYTHON (default python3), GPU_CHECK_STEPS (training steps, default 40),
# GPU_CHECK_WORK (scratch folder for run directories and logs, default a new /tmp folder);
# GPU_CHECK_DEVICE (cuda), GPU_CHECK_MODEL (gpt_small), GPU_CHECK_MICRO (16), GPU_CHECK_GLOBAL (128)
# let the same steps run small on a CPU (e.g. GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=gpt_tiny);
# GPU_CHECK_ONLY: space-separated step names to run (the others are recorded as not run);
# GPU_CHECK_LLAMA / GPU_CHECK_WIDE: the Llama and wide-GPT steps' model overrides;
# GPU_CHECK_DEADLINE_S (480): the whole check's time; a step gets at most what is left, and steps
# that would start with under 30 s left are recorded as not run, so the report is always written.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
WHEELS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --wheels) WHEELS=$2; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (use --dry-run, --wheels DIR)" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-40}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MODEL=${GPU_CHECK_MODEL:-gpt_small}
MICRO=${GPU_CHECK_MICRO:-16}
GLOBAL=${GPU_CHECK_GLOBAL:-128}
DEADLINE=${GPU_CHECK_DEADLINE_S:-480}
ONLY=${GPU_CHECK_ONLY:-}
# about 0.1B parameters: 8 blocks of hidden 1024, grouped-query attention (16 heads, 4 key/value heads)
read -r -a LLAMA <<<"${GPU_CHECK_LLAMA:-model=llama_tiny model.num_layers=8 model.hidden_size=1024 model.num_heads=16 model.num_kv_heads=4 model.ffn_hidden_size=2816 model.seq_len=512}"
# a GPT whose matrix products are large enough to show what the GPU reaches beside gpt_small's
read -r -a WIDE <<<"${GPU_CHECK_WIDE:-model=gpt_small model.num_layers=8 model.hidden_size=2048 model.num_heads=16 model.seq_len=1024}"
START=$(date +%s)
REPORT_DIR=${OUT:-runs/gpu_check}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$REPORT_DIR" "$WORK"
MANIFEST=$WORK/steps.jsonl
: >"$MANIFEST"
export PYTHONUNBUFFERED=1

if [ -n "$WHEELS" ] && [ "$DRY" = 0 ]; then
    SITE=$WORK/site
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl; then
        echo "gpu_check: installing the wheels of $WHEELS failed" >&2
        exit 1
    fi
    export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

REPORT=("$PY" "$ROOT/scripts/gpu_check_report.py")

# step NAME KIND TIMEOUT_S RUN_DIR -- COMMAND...   (RUN_DIR: "-" for none)
step() {
    local name=$1 kind=$2 limit=$3 run_dir=$4
    shift 5
    echo "=== $name: $*"
    if [ "$DRY" = 1 ]; then
        "${REPORT[@]}" record --manifest "$MANIFEST" --name "$name" --kind "$kind" --status dry_run \
            --timeout "$limit" --run-dir "$run_dir" -- "$@"
        return
    fi
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "    -> not run: not in GPU_CHECK_ONLY"
        "${REPORT[@]}" record --manifest "$MANIFEST" --name "$name" --kind "$kind" --status excluded \
            --timeout "$limit" --run-dir "$run_dir" -- "$@"
        return
    fi
    local left=$((DEADLINE - ($(date +%s) - START)))
    if [ "$left" -lt 30 ]; then
        echo "    -> not run: ${left} s of the ${DEADLINE} s budget left"
        "${REPORT[@]}" record --manifest "$MANIFEST" --name "$name" --kind "$kind" --status skipped \
            --timeout "$limit" --run-dir "$run_dir" -- "$@"
        return
    fi
    [ "$limit" -gt $((left - 10)) ] && limit=$((left - 10))
    local out=$WORK/$name.out err=$WORK/$name.err start end rc
    start=$(date +%s.%N)
    timeout -k 15 "$limit" "$@" >"$out" 2>"$err"
    rc=$?
    end=$(date +%s.%N)
    tail -n 5 "$out" | sed 's/^/    /'
    [ "$rc" != 0 ] && tail -n 15 "$err" | sed 's/^/    err: /'
    echo "    -> exit $rc after $(awk "BEGIN{printf \"%.1f\", $end-$start}") s"
    "${REPORT[@]}" record --manifest "$MANIFEST" --name "$name" --kind "$kind" --status ran --rc "$rc" \
        --seconds "$(awk "BEGIN{print $end-$start}")" --timeout "$limit" --run-dir "$run_dir" \
        --stdout "$out" --stderr "$err" -- "$@"
}

# 1. device facts
step device_facts facts 60 - -- "$PY" "$ROOT/scripts/gpu_check_report.py" facts

# 2. the gpu-marked tests; every test's outcome on its own line (-v) and in JUnit XML
step gpu_tests pytest 180 - -- "$PY" -m pytest -m gpu -o addopts= -v -rA -p no:cacheprovider \
    --junitxml="$WORK/gpu_tests.xml" tests

# 3. gpt_small, one GPU, fp32 / bf16 / fp16: 8 micro-batches of 16 sequences of 256 bytes per step
BASE=(parallel.pp=1 cluster.device=$DEVICE train.progress=false trace.enabled=false train.log_every=10
      train.eval_batches=2)
COMMON=(model=$MODEL "${BASE[@]}")
for precision in fp32 bf16 fp16; do
    step "train_$precision" train 90 "$WORK/train_$precision" -- "$PY" -m launcher "${COMMON[@]}" \
        precision=$precision train.steps=$STEPS train.warmup_steps=5 train.micro_batch_size=$MICRO \
        train.global_batch_size=$GLOBAL train.run_dir="$WORK/train_$precision"
done

# 4. Harmony on one GPU (fp32 only; untied embeddings, no dropout, no clipping) and 4 fused models (bf16)
step harmony_pp train 75 "$WORK/harmony_pp" -- "$PY" -m launcher "${COMMON[@]}" schedule=harmony_pp \
    precision=fp32 train.grad_clip=0 model.tie_embeddings=false model.dropout=0 train.steps=10 train.warmup_steps=2 \
    train.run_dir="$WORK/harmony_pp"
step multi_model_4 train 75 "$WORK/multi_model_4" -- "$PY" -m launcher "${COMMON[@]}" train.models=4 \
    precision=bf16 train.steps=10 train.warmup_steps=2 train.run_dir="$WORK/multi_model_4"

# 5. bf16 features; each compares with a run above (the report's comparisons section)
BF16=(precision=bf16 train.steps=$STEPS train.warmup_steps=5)
step train_bf16_compile train 180 "$WORK/train_bf16_compile" -- "$PY" -m launcher "${COMMON[@]}" "${BF16[@]}" \
    train.compile=true train.micro_batch_size=$MICRO train.global_batch_size=$GLOBAL \
    train.run_dir="$WORK/train_bf16_compile"
step train_bf16_selective train 90 "$WORK/train_bf16_selective" -- "$PY" -m launcher "${COMMON[@]}" "${BF16[@]}" \
    recompute.granularity=selective train.micro_batch_size=$MICRO train.global_batch_size=$GLOBAL \
    train.run_dir="$WORK/train_bf16_selective"
step llama_bf16 train 90 "$WORK/llama_bf16" -- "$PY" -m launcher "${LLAMA[@]}" "${BASE[@]}" "${BF16[@]}" \
    train.micro_batch_size=8 train.global_batch_size=64 train.run_dir="$WORK/llama_bf16"
step gpt_wide_bf16 train 90 "$WORK/gpt_wide_bf16" -- "$PY" -m launcher "${WIDE[@]}" "${BASE[@]}" "${BF16[@]}" \
    train.micro_batch_size=8 train.global_batch_size=64 train.run_dir="$WORK/gpt_wide_bf16"
step harmony_pp_bf16 train 75 "$WORK/harmony_pp_bf16" -- "$PY" -m launcher "${COMMON[@]}" schedule=harmony_pp \
    precision=bf16 train.grad_clip=0 model.tie_embeddings=false model.dropout=0 train.steps=10 train.warmup_steps=2 \
    train.run_dir="$WORK/harmony_pp_bf16"
step single_model_bf16 train 60 "$WORK/single_model_bf16" -- "$PY" -m launcher "${COMMON[@]}" \
    precision=bf16 train.steps=10 train.warmup_steps=2 train.run_dir="$WORK/single_model_bf16"

"${REPORT[@]}" write --manifest "$MANIFEST" --work "$WORK" --out "$REPORT_DIR" $([ "$DRY" = 1 ] && echo --dry-run)
rc=$?
echo "=== report: $REPORT_DIR/gpu_check.md, $REPORT_DIR/gpu_check.json"
cat "$REPORT_DIR/gpu_check.md"
exit $rc
