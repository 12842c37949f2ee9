#!/usr/bin/env bash
# Main job on the local default: 1 PS task + 2 Horovod workers on this machine train the LM1B language model
# (lm1b_small preset) on the offline real-English corpus, printing words/s and perplexity.
# Extra arguments go to scripts/train_lm1b.py (e.g. --epochs=5, --architecture=ps, --config=lm1b_tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [[ ! -f data/lm1b_offline/1b_word_vocab.txt ]]; then
  .venv/bin/python scripts/make_lm1b_corpus.py --output_dir data/lm1b_offline
fi
exec .venv/bin/kparallax-run --workers 2 --ps 1 -- .venv/bin/python scripts/train_lm1b.py \
  --config=lm1b_small --data_dir=data/lm1b_offline --model_dir=runs/lm1b_small --epochs=2 --log_every=25 "$@"
