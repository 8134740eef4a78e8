# Sourced by quickstart.sh and .ci/run: install_torch [VERSION] puts torch into the environment whose
# python is $PY, with pip's install command in the array PIP, saying what it does through the caller's
# say. VERSION pins it (.ci/run's torch==VERSION); without, the newest torch>=2.6. Which build:
#   - an NVIDIA GPU (nvidia-smi works): PyPI's, the CUDA build;
#   - macOS and Windows: PyPI's, which is the CPU build there;
#   - Linux without a GPU: the CPU build, not PyPI's multi-GB CUDA one: a "+cpu" wheel that pip's own
#     sources offer (a local wheel folder or index), else download.pytorch.org's CPU index if it
#     answers within 5 s, else PyPI's torch (larger, and it runs on the CPU too).

cpu_torch_offered() {
  # the "+cpu" build of torch VERSION (or, with none, the newest torch>=2.6 built for CPU) that pip's
  # configured sources offer (pip lists the newest first), if any; read by bash: no second Python start
  local listed version
  listed=$("$PY" -m pip index versions torch 2>/dev/null | sed -n 's/.*Available versions: //p')
  for version in ${listed//,/ }; do
    [[ $version =~ ^([0-9]+)\.([0-9]+)(\..*)?\+cpu$ ]] || continue
    (( BASH_REMATCH[1] > 2 || (BASH_REMATCH[1] == 2 && BASH_REMATCH[2] >= 6) )) || continue
    if [ -z "${1:-}" ] || [ "$version" = "$1+cpu" ]; then
      echo "$version"
      return
    fi
  done
}

install_torch() {
  local spec="torch>=2.6" version
  [ -z "${1:-}" ] || spec="torch==$1"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "installing $spec (CUDA build: an NVIDIA GPU is present)"
    "${PIP[@]}" "$spec"
    return
  fi
  if [ "$(uname -s)" != Linux ]; then  # PyPI's torch for macOS and Windows is the CPU build
    say "installing $spec"
    "${PIP[@]}" "$spec"
    return
  fi
  version=$(cpu_torch_offered "${1:-}")
  if [ -n "$version" ]; then
    say "installing torch $version (no NVIDIA GPU: the CPU build)"
    "${PIP[@]}" "torch==$version"
  elif "$PY" -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/", timeout=5)' \
      >/dev/null 2>&1; then
    say "installing $spec from download.pytorch.org/whl/cpu (no NVIDIA GPU: the CPU build)"
    "${PIP[@]}" "$spec" --index-url https://download.pytorch.org/whl/cpu
  else
    say "download.pytorch.org is unreachable: installing PyPI's $spec (its Linux build carries CUDA" \
        "libraries, larger, and runs on the CPU too)"
    "${PIP[@]}" "$spec"
  fi
}
