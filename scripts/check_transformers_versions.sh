#!/usr/bin/env bash
# Run neatpack's non-slow tests on one or more transformers 5.x releases, each in its own venv.
#
#   scripts/check_transformers_versions.sh 5.17.0 [5.0.0 ...]
#
# CI runs only the newest release (pyproject allows transformers>=5,<6); this is the check for
# the older ones users' trainers pin. Each release gets the venv $VENV_ROOT/tf-<version>
# (default VENV_ROOT=/tmp/neatpack-tf), reused when it already exists.
#
# Environment:
#   BASE_VENV=/path/to/venv  layer the release over an existing venv (its torch, torchvision,
#                            av, pytest ... through a .pth file) instead of a full install
#                            (~6 GB of torch); only transformers and its own pins (tokenizers,
#                            huggingface_hub) are installed into the new venv.
#   FOLDERS="families pipes" the test folders under tests/ to run (default: all of them).
#   PYTEST_ARGS="-x"         extra pytest arguments.
#   NICE=19                  the niceness the tests run at (0: none).
#
# Prints one line per folder and a summary; exits 1 when any folder failed. Full logs:
# $VENV_ROOT/tf-<version>/logs/<folder>.txt.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 VERSION [VERSION ...]   (e.g. 5.17.0 5.0.0)" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${VENV_ROOT:-/tmp/neatpack-tf}
folders=${FOLDERS:-"families pipes graphs parity mixtures distributed reliability benchmarks"}
nice_level=${NICE:-19}
status=0

site_packages() {
    "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

build_venv() {
    local version=$1 venv=$2
    python3 -m venv "$venv"
    if [ -n "${BASE_VENV:-}" ]; then
        # the base venv's packages come after this venv's own (a .pth line is appended to
        # sys.path), so this venv's transformers / tokenizers / huggingface_hub win
        site_packages "$BASE_VENV" >"$(site_packages "$venv")/zz_base.pth"
        "$venv/bin/pip" install -q "transformers==$version"
        "$venv/bin/pip" install -q --no-deps -e "$root"
    else
        "$venv/bin/pip" install -q -e "$root[test,dev]" "transformers==$version"
    fi
    touch "$venv/.complete"
}

for version in "$@"; do
    venv=$venv_root/tf-$version
    if [ ! -f "$venv/.complete" ]; then
        rm -rf "$venv"  # a build that stopped half-way
        echo "== building $venv (transformers $version)"
        mkdir -p "$venv_root"
        build_venv "$version" "$venv"
    fi
    got=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
    if [ "$got" != "$version" ]; then
        echo "$venv has transformers $got, not $version: remove it and rerun" >&2
        exit 1
    fi
    mkdir -p "$venv/logs"
    echo "== transformers $version ($venv)"
    for folder in $folders; do
        log=$venv/logs/$folder.txt
        set +e
        (cd "$root" && HF_HUB_OFFLINE=1 nice -n "$nice_level" "$venv/bin/python" -m pytest -q \
            -p no:cacheprovider -m "not slow" ${PYTEST_ARGS:-} "tests/$folder") >"$log" 2>&1
        rc=$?
        set -e
        summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error|skipped|deselected)' \
            "$log" | tail -1 | tr -d '=')
        printf '%-12s rc=%s %s\n' "$folder" "$rc" "$summary"
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
            grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
            status=1
        fi
    done
done
exit "$status"
