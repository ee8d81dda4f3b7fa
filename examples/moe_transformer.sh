#!/usr/bin/env bash
# A mixture-of-experts Transformer (English -> German number words) on a 2x2 mesh,
# from scripts/train_nmt.py's flags alone:
#
#   bash examples/moe_transformer.sh [more flags, which override these]
#
# Every other feed-forward layer is an MoE of 8 experts, top-2 routing (GShard) with
# capacity factor 1.25 and a shared expert beside them; experts, heads, feed-forward
# and vocabulary are split over `model`, the batch over `data`. Every 500 steps it
# prints held-out BLEU and writes a checkpoint that a rerun resumes from.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python}" "$here/../scripts/train_nmt.py" \
    --mesh_shape='data:2;model:2' \
    --layout='batch:data;heads:model;d_ff:model;vocab:model;experts:model' \
    --moe_experts=8 --moe_top_k=2 --moe_shared_d_ff=128 \
    --d_model=64 --d_ff=256 --num_heads=4 --d_kv=16 \
    --num_encoder_layers=2 --num_decoder_layers=2 --max_length=24 --max_tokens=1536 \
    --dropout=0.05 --warmup_steps=200 --steps=2000 --eval_every=500 \
    --model_dir=runs/moe_transformer "$@"
