#!/usr/bin/env bash
# Create .venv with torch (CPU build 2.13.0 unless TORCH_SPEC says otherwise)
# and this package with its test extras; install chromium for the HTML report
# test when no Chromium-family browser is on PATH. Used by the README, .ci/run
# and the workflows (ci/workflows/).
#   TORCH_SPEC       what to pip-install for torch (e.g. "torch==2.14.1", "--pre torch")
#   TORCH_INDEX_URL  a package index for torch (e.g. PyTorch's nightly or CPU wheels)
#   SKIP_BROWSER=1   do not install chromium
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # TORCH_SPEC may be several words ("--pre torch")
python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} ${TORCH_SPEC:-torch==2.13.0}
python -m pip install -q -e ".[test,zoo]"
python -c "import torch, hypothesis; print('torch', torch.__version__, '| hypothesis', hypothesis.__version__)"

have_browser() { command -v chromium || command -v chromium-browser || command -v google-chrome || command -v google-chrome-stable; }
if [ -z "${SKIP_BROWSER:-}" ] && ! have_browser > /dev/null && command -v apt-get > /dev/null; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "installing chromium (Debian package) for the HTML report test"
  if $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium > /dev/null; then
    chromium --version || true
  else
    echo "warning: could not install chromium; the HTML report test will be skipped" >&2
  fi
fi
