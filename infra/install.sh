#!/usr/bin/env bash
# Installs everything expresslane needs into ./.venv. Idempotent: a second run only checks.
# System packages: libibverbs1 (Mooncake's transfer engine links it) and docker-compose (to
# validate docker-compose.yml without a Docker engine), both from apt without recommends.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.expresslane-installed
want="$(cat pyproject.toml infra/install.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

need_apt=()
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${need_apt[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "warning: missing system packages ${need_apt[*]}; install them with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${need_apt[*]}" >&2
  fi
fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "expresslane needs Python >= 3.11 (found $("$PY" --version)); set PYTHON=/path/to/python3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
echo "installing expresslane and its dependencies into .venv (a few minutes the first time)"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[cpu,dev]'
# PyPI serves CUDA builds of these, which break transformers' imports on a CPU torch.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$stamp"
