#!/usr/bin/env bash
# The GPU check, one prepared script within about 8 minutes, for a machine with
# NVIDIA GPUs and a CUDA build of TensorFlow 2.21 (`pip install "tensorflow[and-cuda]==2.21.*"`):
#
#   bash scripts/gpu_check.sh            # writes $OUT (default ./gpu_check_out)/summary.txt
#
# What it runs, each step time-boxed and logged to $OUT/<step>.log:
#   gpus       the GPUs TensorFlow sees (the script stops here if there are none);
#   twin       one GPU against the CPU, same flags, float32 with TF32 off
#              (NVIDIA_TF32_OVERRIDE=0): the loss per step to 1e-5 relative;
#   xla        the same GPU run without XLA (--nojit_compile) against the XLA one;
#   memory     the GPU run's allocator peak in plan.json (tfpar.training.memory):
#              GPU:0 measured, bytes held at least the weights and slots, printed
#              beside the prediction;
#   bf16       --precision=mixed_bfloat16 on the GPU: finite, falling loss;
#   nccl       mirrored over every GPU (NcclAllReduce, its default there) against one GPU
#              (needs 2+ GPUs; said and skipped on one);
#   bench      scripts/bench.py's peer section (tfpar against keras-hub, each in
#              its own process, float32 and mixed_bfloat16, medians and ratios).
# The lent device machine of this project's sessions has no TensorFlow, and its
# wheels are far over what may travel there, so this script has not run on a GPU
# yet (docs/operations.md, "What has and has not run where").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }

step() {  # step NAME SECONDS COMMAND...: runs COMMAND, says its exit status and time.
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  say "$name: exit $rc in $(( $(date +%s) - start )) s (log $OUT/$name.log)"
  return $rc
}

TRAIN=(python -m tfpar.train --flagfile=configs/gpt_tiny.flags --train_steps=30 --eval_every=0
       --checkpoint_every=1000)

# SAME_LOSSES DIR_A DIR_B RTOL: every common step's training loss in both metrics.jsonl.
SAME_LOSSES=(python -c '
import json, sys
def losses(d):
  rows = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}
a, b, rtol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
steps = sorted(set(a) & set(b))
assert steps, "no common steps"
err = max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)
print(f"{len(steps)} steps, largest relative difference {err:.2e} (rtol {rtol:g})")
sys.exit(0 if err <= rtol else 1)
')

step gpus 120 python -c "import tensorflow as tf; g = tf.config.list_physical_devices('GPU'); print(tf.__version__, g); assert g"
if [ $? -ne 0 ]; then
  say "no GPU seen by TensorFlow: nothing else to check"
  exit 1
fi
NGPU=$(python -c "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))" 2>/dev/null)

export NVIDIA_TF32_OVERRIDE=0  # float32 matmuls in float32, so a twin can hold to 1e-5.
step one_gpu 150 "${TRAIN[@]}" --model_dir="$OUT/one_gpu" --strategy=one_device
CUDA_VISIBLE_DEVICES= step one_cpu 150 "${TRAIN[@]}" --model_dir="$OUT/one_cpu" --strategy=one_device
step twin 30 "${SAME_LOSSES[@]}" "$OUT/one_gpu" "$OUT/one_cpu" 1e-5
step memory 30 python -c '
import json, sys
d = sys.argv[1]
plan = json.load(open(f"{d}/plan.json"))
gpu = plan["allocator_peak"]["allocators"]["GPU:0"]
(held,) = plan["measured_bytes_per_device"].values()
print(json.dumps(gpu))
assert gpu["held_bytes"] >= held["parameters"] + held["optimizer"] and gpu["added_bytes"] > 0
' "$OUT/one_gpu"
step one_gpu_noxla 150 "${TRAIN[@]}" --model_dir="$OUT/one_gpu_noxla" --strategy=one_device --nojit_compile
step xla 30 "${SAME_LOSSES[@]}" "$OUT/one_gpu_noxla" "$OUT/one_gpu" 1e-5
step bf16 150 "${TRAIN[@]}" --model_dir="$OUT/bf16" --strategy=one_device --precision=mixed_bfloat16
if [ "${NGPU:-1}" -ge 2 ]; then
  step mirrored_nccl 150 "${TRAIN[@]}" --model_dir="$OUT/nccl" --strategy=mirrored  # NcclAllReduce on GPUs
  step nccl 30 "${SAME_LOSSES[@]}" "$OUT/nccl" "$OUT/one_gpu" 1e-5
else
  say "nccl: skipped, one GPU (NCCL needs two)"
fi
unset NVIDIA_TF32_OVERRIDE
step bench 240 python scripts/bench.py --sections=peer --rounds=2 --precision=float32,mixed_bfloat16 \
  --out="$OUT/bench.json"
tail -n 20 "$OUT/bench.log" >> "$OUT/summary.txt"
