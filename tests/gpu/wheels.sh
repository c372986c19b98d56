#!/usr/bin/env bash
# Prepare the wheel folder tests/gpu/device_check.sh installs on a GPU host that cannot
# download: the pinned wheels of tests/gpu/wheels.txt for CPython 3.12 on x86-64 Linux,
# and splitserve's own wheel built from this tree (used there if the tree cannot be
# built in place). Prints what the folder and the tree that travels with it weigh.
#   bash tests/gpu/wheels.sh [WHEEL_DIR]       (default .whl, ignored by git)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${1:-$root/.whl}"
py="${PYTHON:-python3}"
limit=$((64 << 20))
mkdir -p "$dir"
rm -f "$dir"/*.whl
reqs=$(grep -v '^\s*#' "$here/wheels.txt" | sed 's/#.*//' | xargs)
# shellcheck disable=SC2086  # one argument per pinned wheel
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" $reqs
# from a copy of what the package is made of (no build folder left in the tree)
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
(cd "$root" && cp -r pyproject.toml README.md worker operator proto "$src/")
find "$src" -name __pycache__ -prune -exec rm -rf {} +
"${BUILD_PYTHON:-$root/.venv/bin/python}" -m pip wheel -q --no-deps --no-build-isolation \
  -w "$dir" "$src"
wheels=$(find "$dir" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')
tree=$(cd "$root" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
ls -l "$dir"/*.whl | awk '{printf "  %10d  %s\n", $5, $9}'
awk -v w="$wheels" -v t="$tree" -v l="$limit" 'BEGIN {
  m = 1048576; printf "wheels %.1f MiB + tree %.1f MiB = %.1f MiB of %d MiB a call carries\n",
  w / m, t / m, (w + t) / m, l / m }'
if [ $((wheels + tree)) -gt "$limit" ]; then
  echo "error: over the $((limit >> 20)) MiB a device call carries" >&2
  exit 1
fi
