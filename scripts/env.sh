# Sourced by run.sh and test.sh: choose the Python environment cpullm goes into, and install into
# it only when something that decides the install changed.
#
# A virtual environment the user activated ($VIRTUAL_ENV) is used as it is. Otherwise the
# project's own one, .venv at the repository root, is created on first use and reused. The system
# interpreter is never installed into. $PYTHON picks the interpreter .venv is created from
# (default: python3, else python).
#
# After cpullm_env: $CPULLM_ROOT is the repository, $CPULLM_VENV the environment, $CPULLM_PY its
# python. cpullm_install NAME PIP_ARG... installs once per change of what decides the install.

CPULLM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CPULLM_MIN_PYTHON="3.10"

cpullm_die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

cpullm_say() {
    echo "$(basename "$0"): $*" >&2
}

# The interpreter inside a virtual environment (bin/ on POSIX, Scripts/ on Windows).
cpullm_venv_python() {
    local py
    for py in "$1/bin/python" "$1/Scripts/python.exe"; do
        if [ -x "$py" ]; then
            echo "$py"
            return 0
        fi
    done
    return 1
}

# Exits with a message naming the fix unless $1 runs and is Python 3.10 or newer.
cpullm_check_python() {
    local py=$1 where=$2 version
    version=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) \
        || cpullm_die "$where ($py) does not run; $3"
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        cpullm_die "cpullm needs Python $CPULLM_MIN_PYTHON or newer, but $where ($py) is Python $version; $3"
    fi
}

cpullm_create_venv() {
    local base=${PYTHON:-} where="PYTHON"
    if [ -z "$base" ]; then
        base=$(command -v python3 || command -v python) \
            || cpullm_die "no python3 on PATH; install Python $CPULLM_MIN_PYTHON or newer, or set PYTHON=/path/to/python3"
        where="the python3 on PATH"
    fi
    cpullm_check_python "$base" "$where" \
        "install Python $CPULLM_MIN_PYTHON or newer and run again with PYTHON=/path/to/python3.12"
    if ! "$base" -m venv "$CPULLM_VENV" >&2; then
        rm -rf "$CPULLM_VENV"
        cpullm_die "could not create a virtual environment with $base (on Debian/Ubuntu: apt install python3-venv)"
    fi
}

cpullm_env() {
    local how
    if [ -n "${VIRTUAL_ENV:-}" ]; then
        CPULLM_VENV=$VIRTUAL_ENV
        CPULLM_PY=$(cpullm_venv_python "$CPULLM_VENV") \
            || cpullm_die "the active virtual environment $CPULLM_VENV has no python; deactivate it, or recreate it"
        cpullm_check_python "$CPULLM_PY" "the active virtual environment" \
            "deactivate it (the scripts then use .venv in the repository) or activate a newer one"
        "$CPULLM_PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' \
            || cpullm_die "VIRTUAL_ENV=$CPULLM_VENV is not a virtual environment; deactivate it, or create one with python3 -m venv"
        how="the active virtual environment"
    else
        CPULLM_VENV=$CPULLM_ROOT/.venv
        how="the project's virtual environment"
        if [ ! -e "$CPULLM_VENV" ]; then
            cpullm_create_venv
            how="$how, created now"
        fi
        CPULLM_PY=$(cpullm_venv_python "$CPULLM_VENV") \
            || cpullm_die "$CPULLM_VENV is not a virtual environment; remove it (rm -rf .venv) and run again"
        cpullm_check_python "$CPULLM_PY" "the virtual environment .venv" \
            "remove it (rm -rf .venv) and run again with PYTHON=/path/to/python3.12"
    fi
    cpullm_say "packages go to $CPULLM_VENV ($how; activate it with: source $CPULLM_VENV/bin/activate)"
}

# cpullm_install NAME PIP_ARG...: pip install PIP_ARG... unless the same install already happened
# into this environment (same pyproject files, constraints, arguments, interpreter and checkout).
cpullm_install() {
    local name=$1 key stamp
    shift
    stamp=$CPULLM_VENV/.cpullm-$name.installed
    if key=$("$CPULLM_PY" "$CPULLM_ROOT/scripts/install_state.py" "$@") \
        && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
        return 0
    fi
    "$CPULLM_PY" -m pip --version >/dev/null 2>&1 \
        || cpullm_die "$CPULLM_VENV has no pip; add it with: $CPULLM_PY -m ensurepip"
    cpullm_say "installing (first run, or pyproject.toml, constraints.txt or the interpreter changed; can take minutes): pip install $*"
    (cd "$CPULLM_ROOT" && "$CPULLM_PY" -m pip install -q --disable-pip-version-check "$@")
    key=$("$CPULLM_PY" "$CPULLM_ROOT/scripts/install_state.py" "$@") \
        || cpullm_die "pip finished, but cpullm or a plugin is not installed from $CPULLM_ROOT"
    printf '%s\n' "$key" >"$stamp.tmp"
    mv "$stamp.tmp" "$stamp"
}
