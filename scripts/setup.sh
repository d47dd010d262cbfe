#!/usr/bin/env bash
# Create .venv with torch and this project installed. Idempotent; safe to re-run.
#   scripts/setup.sh          runtime only (psserver, psworker, pscluster, psctl)
#   scripts/setup.sh --test   also the test tools
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU wheel on our
# machines). GPU users: install the CUDA build of torch into .venv first, and TORCH_SPEC=torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # torch first and pinned: an unpinned torch would pull several GB of CUDA packages.
    .venv/bin/pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras}"
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')" >&2
