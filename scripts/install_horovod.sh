#!/usr/bin/env bash
# Builds and installs Horovod 0.28.1 (Gloo, no MPI) against the installed TensorFlow.
#
#   scripts/install_horovod.sh [PYTHON]      # default: .venv/bin/python
#
# Idempotent: does nothing when `import horovod.tensorflow` already works.
# Horovod's last release predates TF 2.16; building it needs two Debian header
# packages that TF's headers include, and forwarding headers for XLA headers
# that moved (ARCHITECTURE.md). The built wheel is cached in
# ${TFDIST_WHEEL_CACHE:-$HOME/.cache/tfdist/wheels}, so a second machine setup
# on the same host installs in seconds.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VERSION=0.28.1
CACHE="${TFDIST_WHEEL_CACHE:-$HOME/.cache/tfdist/wheels}"

if "$PY" -c "import horovod.tensorflow" 2>/dev/null; then
    echo "install_horovod: horovod.tensorflow already imports; nothing to do."
    exit 0
fi

wheel=$(ls "$CACHE"/horovod-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$wheel" ]; then
    echo "install_horovod: installing cached $wheel"
    "$PY" -m pip install --quiet "$wheel"  # with horovodrun's dependencies
    "$PY" -c "import horovod.tensorflow"
    exit 0
fi

missing=""
for pkg in libhighwayhash-dev libfarmhash-dev cmake g++; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    echo "install_horovod: apt-get install$missing"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi

include=$(mktemp -d)
trap 'rm -rf "$include"' EXIT
forward() {  # forward <old path under tensorflow/compiler/> <new path>
    mkdir -p "$include/$(dirname "$1")"
    echo "#include \"$2\"" > "$include/$1"
}
forward tensorflow/compiler/xla/client/xla_builder.h xla/hlo/builder/xla_builder.h
for h in service/custom_call_target_registry.h service/hlo.pb.h shape.h xla_data.pb.h; do
    forward "tensorflow/compiler/xla/$h" "xla/$h"
done
# Horovod's setup.py builds RelWithDebInfo (-O2 -g). Without the debug info the
# build takes 250 CPU-seconds instead of 345 (2:29 instead of 3:29 on 2 cores)
# and the wheel is 1 MB instead of 15. The -g0 must come after CMake's -g.
printf '#!/bin/sh\nexec %s "$@" -g0\n' "${CXX:-g++}" > "$include/cxx"
chmod +x "$include/cxx"

echo "install_horovod: building horovod==$VERSION (about 3 minutes on 2 cores)"
mkdir -p "$CACHE"
"$PY" -m pip install --quiet setuptools wheel packaging  # --no-build-isolation needs them
CXX="$include/cxx" CPLUS_INCLUDE_PATH="$include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$CACHE" "horovod==$VERSION"
"$PY" -m pip install --quiet "$CACHE"/horovod-"$VERSION"-*.whl
"$PY" -c "import horovod, horovod.tensorflow; print('install_horovod: horovod', horovod.__version__)"
