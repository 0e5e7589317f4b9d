#!/usr/bin/env bash
# Check that one package is ready to release, and print the commands that release it.
# Run `bash scripts/release.sh --help` for the steps; the help text is the block below.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/release.sh PACKAGE [--dry-run] [--quick]

PACKAGE is a distribution name (moestack-kernels) or its folder under packages/ (moe-kernels).

Checks, in order, and stops at the first failure (exit 1, one line on stderr):
  1. the package's version differs from the version of its last release tag
     (<distribution>-v<version>, e.g. moestack-kernels-v0.1.0, from `git tag --list`);
  2. its CHANGELOG.md has an entry (a "## <version>" heading) for that version;
  3. `uv build` makes its sdist and wheel, and `twine check` passes on both;
  4. the wheel, installed alone into a fresh venv (moestack-* siblings as wheels built
     here, third-party dependencies pinned to uv.lock), passes the package's tests
     (tests/<import name>/), run outside the source tree against the installed wheel.

  --dry-run  do all of the checks, then say that nothing is to be published.
  --quick    run the tests with -m "not slow" (tests marked slow are skipped).

This script never tags and never uploads. Without --dry-run it ends by printing the exact
`git tag` and `twine upload` commands to run by hand; the built files stay in dist/<distribution>/.
EOF
}

fail() { echo "release.sh: $*" >&2; exit 1; }

source scripts/packages.sh  # packages, module_of, wheel_deps
# What the package's tests import beyond the package and its dependencies (pinned to uv.lock).
# numpy for moestack-kernels: without a GPU its tests run Triton kernels under the Triton
# interpreter (tests/moe_kernels/conftest.py), which imports numpy. numpy for moestack-parallel:
# its tests gather Python objects across ranks (torch's *_object collectives need numpy).
declare -A test_deps=(
  [moestack-kernels]="pytest torchao numpy"
  [moestack-checkpoint]="pytest"
  [moestack-devices]="pytest"
  [moestack-dispatch]="pytest"
  [moestack-parallel]="pytest numpy"
  [moestack-data]="pytest torch tokenizers pyarrow zstandard datasets"
  [moestack-plan]="pytest"
  [moestack-train]="pytest tokenizers transformers tensorboard wandb"
)

package="" dry_run=0 quick=0
for arg in "$@"; do
  case $arg in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --quick) quick=1 ;;
    -*) fail "unknown option $arg (see --help)" ;;
    *) [[ -z $package ]] || fail "one package at a time (got $package and $arg)"; package=$arg ;;
  esac
done
[[ -n $package ]] || { usage >&2; exit 1; }
case $package in
  moestack-*) dist=$package folder=moe-${package#moestack-} ;;
  moe-*) dist=moestack-${package#moe-} folder=$package ;;
  *) dist="" folder="" ;;
esac
[[ -n $dist && -n ${module_of[$dist]+x} && -d packages/$folder ]] ||
  fail "unknown package '$package': expected one of $(printf '%s\n' "${!module_of[@]}" | sort | paste -sd ' ') (or its folder name, e.g. moe-kernels)"
module=${module_of[$dist]}
[[ -n ${test_deps[$dist]+x} ]] || fail "$dist: scripts/release.sh has no test_deps entry for it"
tests_dir=tests/$module
[[ -d $tests_dir ]] || fail "$dist: no test folder $tests_dir"

# 1. The version must be new.
version_file=packages/$folder/src/$module/__init__.py  # its __version__ ([tool.hatch.version])
version=$(sed -nE 's/^__version__ = "([^"]+)"$/\1/p' "$version_file" | head -n 1)
[[ -n $version ]] || fail "$dist: no __version__ in $version_file"
last_tag=$(git tag --list "$dist-v*" --sort=-version:refname | head -n 1)
if [[ -n $last_tag && ${last_tag#"$dist-v"} == "$version" ]]; then
  fail "$dist $version is already released (tag $last_tag): bump __version__ in $version_file"
fi
if [[ -n $(git tag --list "$dist-v$version") ]]; then
  fail "$dist $version is already tagged ($dist-v$version): bump __version__ in $version_file"
fi
# 2. The changelog must describe it.
grep -qE "^## \[?${version//./\\.}\]?([[:space:]]|$)" "packages/$folder/CHANGELOG.md" ||
  fail "$dist $version: packages/$folder/CHANGELOG.md has no '## $version' entry"
echo "== $dist $version (last release tag: ${last_tag:-none})"

# 3. Build and check the sdist and wheel.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=dist/$dist
rm -rf "$out"
mkdir -p "$out"
uv build --quiet --package "$dist" --out-dir "$out" 2>"$work/build.log" ||
  { cat "$work/build.log" >&2; fail "$dist: uv build failed"; }
sdist=("$out"/"${dist//-/_}"-"$version".tar.gz)
wheel=("$out"/"${dist//-/_}"-"$version"-*.whl)
[[ -f ${sdist[0]} && -f ${wheel[0]} ]] || fail "$dist: uv build did not make ${dist//-/_}-$version sdist and wheel"
uv run --frozen --quiet twine --no-color check --strict "${sdist[0]}" "${wheel[0]}"

# 4. Install the wheel alone (siblings as wheels built here, third-party pinned) and test it.
# Pins for everything in the lock, dev group included (pytest, torchao, ...); constraints only
# pin, they install nothing.
uv export --frozen --all-extras --no-emit-workspace --no-hashes -o "$work/constraints.txt" >/dev/null
wheels=("${wheel[0]}")
for sibling in ${wheel_deps[$dist]}; do
  uv build --quiet --package "$sibling" --wheel --out-dir "$work/siblings" 2>"$work/build.log" ||
    { cat "$work/build.log" >&2; fail "$dist: uv build of sibling $sibling failed"; }
  files=("$work"/siblings/"${sibling//-/_}"-*.whl)
  wheels+=("${files[0]}")
done
venv=$work/venv
uv venv --quiet --python 3.11 "$venv"
# shellcheck disable=SC2086  # test_deps is a word list
uv pip install --quiet --python "$venv/bin/python" -c "$work/constraints.txt" \
  "${wheels[@]}" ${test_deps[$dist]}
# The tests run from a copy outside the source tree; only the shared helpers (tests/*.py,
# not the tests in it, and benchmarks/harness, whose multi-process runner the tests use) are on
# PYTHONPATH, so the package can only come from the venv.
mkdir -p "$work/run/helpers"
cp -r "$tests_dir" "$work/run/"
find tests -maxdepth 1 -name '*.py' ! -name 'test_*' ! -name 'conftest.py' -exec cp {} "$work/run/helpers/" \;
cp -r benchmarks/harness "$work/run/helpers/"
cat >"$work/run/pytest.ini" <<'EOF'
[pytest]
addopts = -ra --strict-markers
markers =
    gpu: needs a CUDA device; skipped without one
    slow: takes more than a few seconds on 2 CPU cores
EOF
export PYTHONPATH=$work/run/helpers
cd "$work/run"
"$venv/bin/python" - "$module" "$venv" <<'PY'
import importlib, os, sys
module, venv = sys.argv[1:]
path = importlib.import_module(module).__file__
print(f"{module}.__file__ = {path}")
if not os.path.realpath(path).startswith(os.path.realpath(venv) + os.sep):
    sys.exit(f"release.sh: {module} is not imported from the test venv: {path}")
PY
select=()
(( quick )) && select=(-m "not slow")
"$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$work/run" "${select[@]}" "$module" ||
  fail "$dist $version: the tests fail against the installed wheel"
cd - >/dev/null

echo "== $dist $version is ready: ${sdist[0]} ${wheel[0]}"
if (( dry_run )); then
  echo "Dry run: nothing is to be published (no tag, no upload)."
else
  echo "To release it, run (this script does not tag or upload):"
  echo "  git tag -a $dist-v$version -m \"$dist $version\" && git push origin $dist-v$version"
  echo "  uv run --frozen twine upload ${sdist[0]} ${wheel[0]}"
fi
