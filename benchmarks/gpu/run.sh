#!/usr/bin/env bash
# The GPU campaign in one command (issues #19, #14, #15, #31, #32, #33): what a session with the
# lent GPU runs.
#
#   bash benchmarks/gpu/run.sh STAGE [STAGE ...]
#
# Stages, each within one 10-minute device command when run alone (benchmarks/gpu/README.md):
#   env        nvidia-smi, torch, impasto doctor
#   ceilings   bf16 matmul TFLOP/s and device copy GB/s of this card (ceilings.py)
#   tests      the CUDA tests (those that skip on a CPU)
#   sdxl-512   impasto bench --model sdxl at 512²: the diffusers step and the core variants
#   sdxl-1024  the same at 1024²
#   sdxl-1024-compile   the diffusers step, compile (regional), compile_unet, cuda_graphs
#   sdxl-1024-memory    the diffusers step, adafactor, offload, adamw_8bit (fetch_wheels --bnb)
#   fsdp       parallel.strategy fsdp on 1 rank (NCCL) against none, sdxl at 1024² (#14)
#   draftp     DRaFT+ steps of sdxl at 1024², LoRA 32, K=1, checkpointing: time, memory (#15)
#   cache      impasto cache: VAE latents of 1024² images, img/s
#   train-cached  configs/sdxl-lora.yaml trained on that cache: step time, MFU, data wait
#   dit-tiny   impasto bench --model dit-tiny: packed against padded, FLOPs per token (#31)
#   dit-xl     the same for DiT-XL/2 at 256², 48 images (a pack of 11776 tokens): MFU (#31)
#   dit-video  impasto bench --model dit-7b-video: the 7B video DiT on one 8192-token clip (the
#              seed's 8k context), tokens/s, TFLOP/s and MFU per GPU beside the seed's (#32)
#   flux-lora  impasto bench --model flux-dev: a LoRA step on one 1024² image, float8 base,
#              text encoders released: step time and peak memory (#33: at most 20 GB)
#
# On the device (first, here: bash benchmarks/gpu/fetch_wheels.sh):
#   run(command="DEADLINE_S=330 bash benchmarks/gpu/run.sh env ceilings tests fsdp draftp sdxl-1024",
#       carry=[".whl"], timeout_s=590)   (the plan for 15 minutes of device time: README.md)
# Every stage adds its numbers to $OUT/results.json and the table $OUT/results.md (report.py)
# and its output to $OUT/log.txt; a failed stage is recorded and the next one runs.
#
# DRY_RUN=1 runs every stage on this machine's CPU with the tiny model and few steps: it checks
# the plumbing (CI does: tests/test_gpu_script.py), so that device time goes to measuring.
# Knobs (environment): BATCH_512, BATCH_1024, STEPS, WARMUP, ROUNDS, VARIANTS,
# COMPILE_VARIANTS, MEMORY_VARIANTS, TRAIN_STEPS, DIT_BATCH, VIDEO_VARIANTS, PYTHON,
# DEADLINE_S (start no stage after this many seconds; the report is rewritten after every
# stage either way).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$REPO/benchmarks/gpu/out}"
WORK="${WORK:-/tmp/impasto-gpu}"
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"

if [[ "$DRY_RUN" == 1 ]]; then
    MODEL=tiny; RES_LOW=64; RES_HIGH=64; BATCH_512="${BATCH_512:-2}"; BATCH_1024="${BATCH_1024:-2}"
    STEPS="${STEPS:-2}"; WARMUP="${WARMUP:-1}"; ROUNDS="${ROUNDS:-1}"
    VARIANTS="${VARIANTS:-default lora_r32}"; DRAFTP_STEPS=4; CACHE_IMAGES=8; TRAIN_STEPS=4
    COMPILE_VARIANTS="${COMPILE_VARIANTS:-compile}"; MEMORY_VARIANTS="${MEMORY_VARIANTS:-adafactor}"
    # the compile stage's plumbing, not inductor: its C++ build of the tiny UNet takes minutes
    # on a CPU (tests/test_memory.py compiles with inductor)
    COMPILE_ARGS=(--set memory.compile_backend=eager)
    DIT_XL=dit-tiny; DIT_RES=64; DIT_BATCH="${DIT_BATCH:-3}"
    VIDEO_MODEL=dit-video-tiny; VIDEO_ARGS=(--resolution 64 --frames 9 --batch 1)
else
    MODEL=sdxl; RES_LOW=512; RES_HIGH=1024; BATCH_512="${BATCH_512:-16}"
    BATCH_1024="${BATCH_1024:-4}"; STEPS="${STEPS:-10}"; WARMUP="${WARMUP:-3}"
    ROUNDS="${ROUNDS:-2}"; DRAFTP_STEPS=40; CACHE_IMAGES=256; TRAIN_STEPS="${TRAIN_STEPS:-40}"
    VARIANTS="${VARIANTS:-default channels_last fused pure_bf16 checkpointing low_memory lora_r32}"
    COMPILE_VARIANTS="${COMPILE_VARIANTS:-compile compile_unet cuda_graphs}"; COMPILE_ARGS=()
    MEMORY_VARIANTS="${MEMORY_VARIANTS:-adafactor offload adamw_8bit}"
    DIT_XL=dit-xl; DIT_RES=256; DIT_BATCH="${DIT_BATCH:-48}"
    VIDEO_MODEL=dit-7b-video; VIDEO_ARGS=()  # its own clip: 125 frames at 256², 8192 tokens
fi
# The 7B's fp32 weights, gradients and AdamW moments (113 GiB) do not fit one H100: adafactor
# keeps fp32 weights only (no gradients kept: fused backward; factored moments), with
# gradient checkpointing for the activations of 8192 tokens. low_memory (bf16 weights and
# AdamW moments) also fits; the meta device cannot check it beforehand.
VIDEO_VARIANTS="${VIDEO_VARIANTS:-adafactor}"

setup() {
    # The carried wheels (fetch_wheels.sh) into a folder of their own, where the packages are
    # missing (the device image); impasto from this tree.
    local site="$WORK/site"
    if ! "$PY" -c "import diffusers, pydantic" 2>/dev/null && [[ ! -d "$site" ]]; then
        compgen -G "$REPO/.whl/*.whl" >/dev/null || {
            echo "run.sh: diffusers or pydantic missing and no wheels in .whl/: run"
            echo "  bash benchmarks/gpu/fetch_wheels.sh here and carry .whl"; return 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$REPO"/.whl/*.whl || return 1
    fi
    export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
    [[ -d "$site" ]] && export PYTHONPATH="$PYTHONPATH:$site"
    export PYTHONUNBUFFERED=1
    [[ "$DRY_RUN" == 1 ]] && export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
    "$PY" -c "import impasto, diffusers, pydantic" || {
        echo "run.sh: impasto cannot be imported; carry the wheels (fetch_wheels.sh)"; return 1; }
}

impasto() { "$PY" -m impasto "$@"; }

stage_env() {
    { nvidia-smi || true; "$PY" -c "import torch; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() \
else 'cpu')"; impasto doctor; } > "$WORK/env.txt" 2>&1
    cat "$WORK/env.txt"
    "$PY" - "$WORK/env.txt" > "$WORK/env.json" <<'PYEOF'
import json, sys
print(json.dumps({"text": open(sys.argv[1]).read()[-4000:]}))
PYEOF
}

stage_ceilings() { "$PY" "$REPO/benchmarks/gpu/ceilings.py" --json "$WORK/ceilings.json"; }

stage_tests() {
    # The tests that need CUDA skip on a CPU; these files hold them (and their CPU twins).
    local files
    files=$(grep -l "cuda.is_available" "$REPO"/tests/test_*.py | tr '\n' ' ')
    # A dry run checks the stage in one process (the suite running it has the cores busy) and
    # selects the CUDA tests only: they skip on a CPU, and the suite runs their CPU twins anyway.
    local workers=auto select=()
    [[ "$DRY_RUN" == 1 ]] && workers=0 && select=(-k "gpu or cuda")
    (cd "$REPO" && "$PY" -m pytest -q -rs -p no:cacheprovider -n "$workers" "${select[@]}" $files) 2>&1 \
        | tee "$WORK/tests.txt"
    local status=${PIPESTATUS[0]}
    "$PY" - "$WORK/tests.txt" "$status" > "$WORK/tests.json" <<'PYEOF'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
summary = next((l for l in reversed(lines) if any(w in l for w in (" passed", " failed", " skipped"))), "")
skipped = [l for l in lines if l.startswith("SKIPPED")]
print(json.dumps({"summary": summary.strip("= "), "exit": int(sys.argv[2]), "skipped": skipped}))
PYEOF
    return "$status"
}

bench() {  # bench NAME RESOLUTION BATCH [extra args]
    local name=$1 resolution=$2 batch=$3
    shift 3
    # shellcheck disable=SC2086  # VARIANTS is a list of words
    impasto bench --model "$MODEL" --resolution "$resolution" --batch "$batch" \
        --steps "$STEPS" --warmup "$WARMUP" --rounds "$ROUNDS" --precision bf16 "$@" \
        --json-file "$WORK/$name.json"
}

# A dry run runs some stages with the very arguments of an earlier one (the tiny model at 64²):
# it reuses that stage's results instead of timing the same command twice.
dry_twin() {  # dry_twin NAME TWIN: true (and NAME's results are TWIN's) in a dry run after TWIN
    [[ "$DRY_RUN" == 1 && -f "$WORK/$2.json" ]] || return 1
    cp "$WORK/$2.json" "$WORK/$1.json"
    echo "dry run: $1 has the arguments of $2, whose results it copies"
}

stage_sdxl_512() { bench sdxl-512 "$RES_LOW" "$BATCH_512" --variants $VARIANTS; }
stage_sdxl_1024() {
    if [[ "$RES_HIGH/$BATCH_1024" == "$RES_LOW/$BATCH_512" ]] && dry_twin sdxl-1024 sdxl-512; then
        return 0
    fi
    bench sdxl-1024 "$RES_HIGH" "$BATCH_1024" --variants $VARIANTS
}
stage_sdxl_1024_compile() {
    bench sdxl-1024-compile "$RES_HIGH" "$BATCH_1024" --variants $COMPILE_VARIANTS \
        "${COMPILE_ARGS[@]}"
}
stage_sdxl_1024_memory() {
    bench sdxl-1024-memory "$RES_HIGH" "$BATCH_1024" --variants $MEMORY_VARIANTS
}
stage_fsdp() { bench fsdp "$RES_HIGH" "$BATCH_1024" --parallel fsdp --nproc 1 --variants default; }

dit_bench() {  # dit_bench NAME MODEL RESOLUTION BATCH: packed against padded, interleaved
    local name=$1 model=$2 resolution=$3 batch=$4
    impasto bench --model "$model" --resolution "$resolution" --batch "$batch" --steps "$STEPS" \
        --warmup "$WARMUP" --rounds "$((ROUNDS > 1 ? ROUNDS : 2))" --precision bf16 \
        --json-file "$WORK/$name.json"
}
# The tiny DiT: the demo's three aspect ratios, 12 images at 256² (64² and 3 in a dry run).
stage_dit_tiny() {
    if [[ "$DRY_RUN" == 1 ]]; then dit_bench dit-tiny dit-tiny 64 3; else dit_bench dit-tiny dit-tiny 256 12; fi
}
stage_dit_xl() {
    if [[ "$DIT_XL/$DIT_RES/$DIT_BATCH" == "dit-tiny/64/3" ]] && dry_twin dit-xl dit-tiny; then
        return 0
    fi
    dit_bench dit-xl "$DIT_XL" "$DIT_RES" "$DIT_BATCH"
}

# The video DiT (#32): one clip of the seed's 8k context on one GPU, packed alone (one shape:
# nothing to pad); tokens/s, TFLOP/s and MFU per GPU, tabled beside the seed's (report.py).
stage_dit_video() {
    # shellcheck disable=SC2086  # VIDEO_VARIANTS is a list of words
    impasto bench --model "$VIDEO_MODEL" ${VIDEO_ARGS[@]+"${VIDEO_ARGS[@]}"} --steps "$STEPS" \
        --warmup "$WARMUP" --rounds "$((ROUNDS > 1 ? ROUNDS : 2))" --precision bf16 \
        --variants $VIDEO_VARIANTS --json-file "$WORK/dit-video.json"
}

# FLUX.1-dev LoRA (#33): one 1024² image, the base in float8, gradient checkpointing, the text
# encoders released as a run releases them (the batch carries the encodings): step time and
# peak memory, the issue's goal at most 20 GB. flux-tiny at 64² in a dry run.
stage_flux_lora() {
    local model=flux-dev resolution=1024
    [[ "$DRY_RUN" == 1 ]] && model=flux-tiny resolution=64
    impasto bench --model "$model" --resolution "$resolution" --batch 1 --steps "$STEPS" \
        --warmup "$WARMUP" --rounds 1 --precision bf16 --variants default \
        --set parts.transformer=lora --set memory.frozen_dtype=float8 \
        --set memory.gradient_checkpointing=all --set cache.text_embeddings=memory \
        --json-file "$WORK/flux-lora.json"
}

stage_draftp() {
    local run="$WORK/draftp-run" size="$RES_HIGH"
    rm -rf "$run"
    if [[ "$DRY_RUN" == 1 ]]; then
        "$PY" "$REPO/benchmarks/gpu/make_reward.py" "$WORK/pickscore" --tiny || return 1
    else
        "$PY" "$REPO/benchmarks/gpu/make_reward.py" "$WORK/pickscore" || return 1
    fi
    printf '%s\n' "a photo of an astronaut riding a horse" "a watercolor lighthouse at dawn" \
        "an old fisherman, dramatic light" > "$WORK/prompts.txt"
    impasto train "$REPO/configs/sdxl-draftp.yaml" --no-resume \
        --set model.preset="$MODEL" --set reward.path="$WORK/pickscore" \
        --set data.prompts="$WORK/prompts.txt" --set data.resolution="$size" \
        --set draftp.num_steps="$DRAFTP_STEPS" --set train.max_steps=3 \
        --set train.output_dir="$run" --set sample.every_steps=0 \
        --set checkpoint.save_final=false --set log.every_steps=1 \
        --set log.progress_bar=false --set log.tensorboard=false || return 1
    "$PY" - "$run/metrics.jsonl" "$size" "$DRAFTP_STEPS" > "$WORK/draftp.json" <<'PYEOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
keys = ("step", "step_time", "peak_memory_gib", "peak_rss_gib", "reward", "kl", "tflops")
print(json.dumps({"resolution": int(sys.argv[2]), "sampler_steps": int(sys.argv[3]),
                  "steps": [{k: r[k] for k in keys if k in r} for r in records if "loss" in r]}))
PYEOF
}

stage_cache() {
    local images="$WORK/cache-images" size="$RES_HIGH"
    rm -rf "$images"
    impasto data demo "$images" --num-images "$CACHE_IMAGES" --size "$size" >/dev/null || return 1
    impasto cache "$REPO/configs/sdxl-lora.yaml" --set model.preset="$MODEL" \
        --set data.path="$images" --set data.resolution="$size" \
        --set cache.dir="$WORK/cache" --set train.output_dir="$WORK/cache-run" \
        | tee "$WORK/cache.txt" || return 1
    "$PY" - "$WORK/cache.txt" "$CACHE_IMAGES" "$size" > "$WORK/cache.json" <<'PYEOF'
import json, re, sys
text = open(sys.argv[1]).read()
# "cache: N images; latents N encoded, ...; text M encoded, ... (S s)": latents and captions
seconds = re.search(r"\(([0-9.]+) s\)", text)
encoded = re.search(r"latents (\d+) encoded", text)
count = int(encoded.group(1)) if encoded else int(sys.argv[2])
rate = count / float(seconds.group(1)) if seconds and float(seconds.group(1)) > 0 else None
print(json.dumps({"images": count, "resolution": int(sys.argv[3]), "text": text[-800:],
                  "images_per_s": rate}))
PYEOF
}

stage_train_cached() {
    # configs/sdxl-lora.yaml as a user runs it, on the cache the cache stage filled: the step
    # time, images/s, MFU and the fraction of time the step waited for data (#19 item 5).
    [[ -d "$WORK/cache" ]] || stage_cache || return 1
    local run="$WORK/train-cached-run"
    rm -rf "$run"
    impasto train "$REPO/configs/sdxl-lora.yaml" --no-resume --set model.preset="$MODEL" \
        --set data.path="$WORK/cache-images" --set data.resolution="$RES_HIGH" \
        --set cache.dir="$WORK/cache" --set train.output_dir="$run" \
        --set train.max_steps="$TRAIN_STEPS" --set sample.every_steps=0 \
        --set checkpoint.every_steps=100000 --set checkpoint.save_final=false \
        --set log.every_steps=1 --set log.progress_bar=false --set log.tensorboard=false || return 1
    "$PY" - "$run/metrics.jsonl" "$RES_HIGH" > "$WORK/train-cached.json" <<'PYEOF'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
steady = records[len(records) // 4 :] or records  # past the warm-up (allocator, kernels)
def median(key):
    values = [r[key] for r in steady if key in r]
    return statistics.median(values) if values else None
print(json.dumps({"resolution": int(sys.argv[2]), "steps": len(records),
                  "measured_steps": len(steady), "step_time": median("step_time"),
                  "samples_per_s": median("samples_per_s"), "data_wait": median("data_wait"),
                  "mfu": median("mfu"), "tflops": median("tflops"),
                  "peak_memory_gib": median("peak_memory_gib")}))
PYEOF
}

STAGES=(env ceilings tests sdxl-512 sdxl-1024 sdxl-1024-compile sdxl-1024-memory fsdp draftp cache
        train-cached dit-tiny dit-xl dit-video flux-lora)
[[ $# -eq 0 ]] && { sed -n '2,37p' "$0"; exit 2; }
[[ "$1" == all ]] && set -- "${STAGES[@]}"
for stage in "$@"; do
    [[ " ${STAGES[*]} " == *" $stage "* ]] || { echo "run.sh: unknown stage $stage; valid: ${STAGES[*]}"; exit 2; }
done
setup >>"$LOG" 2>&1 || { tail -5 "$LOG"; exit 1; }

report() { "$PY" "$REPO/benchmarks/gpu/report.py" "$WORK" --out "$OUT"; }

run_stage() {  # run_stage NAME: its output to the log, its exit status and time to WORK
    local stage=$1 started=$SECONDS status
    echo "== $stage ($(date -u +%H:%M:%S))" | tee -a "$LOG"
    rm -f "$WORK/$stage.json"  # an earlier call's numbers are not this one's
    "stage_${stage//-/_}" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    echo "{\"stage\": \"$stage\", \"exit\": $status, \"seconds\": $((SECONDS - started))}" \
        > "$WORK/$stage.status.json"
    [[ $status -eq 0 ]] || echo "run.sh: stage $stage failed ($status)" | tee -a "$LOG"
    return "$status"
}

failed=0
for stage in "$@"; do
    if [[ -n "${DEADLINE_S:-}" && $SECONDS -ge $DEADLINE_S ]]; then
        # Past the deadline no stage starts: a command killed at its limit brings back nothing
        # of the stage it was in, so the ones that fit finish and are reported instead.
        echo "run.sh: stage $stage not started: ${SECONDS} s used of DEADLINE_S=$DEADLINE_S" \
            | tee -a "$LOG"
        [[ -f "$WORK/$stage.status.json" ]] ||  # an earlier call's result of it stays
            echo "{\"stage\": \"$stage\", \"exit\": \"not started\", \"seconds\": 0}" \
                > "$WORK/$stage.status.json"
        failed=1
    else
        run_stage "$stage" || failed=1
    fi
    report >/dev/null 2>>"$LOG"  # results so far are in $OUT even if the command is killed later
done
tee -a "$LOG" < "$OUT/results.md"
exit $failed

