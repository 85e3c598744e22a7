# Shared by scripts/*.sh: make .venv hold this checkout's package with the given extras.
venv_ready() {
    local extras="$1"
    local python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "lonnymq needs Python 3.11 or newer ($python is $("$python" --version 2>&1))" >&2
        exit 1
    fi
    if [ ! -x .venv/bin/python ]; then
        "$python" -m venv .venv
    fi
    local stamp=".venv/.lonnymq-$extras"
    local want
    want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "Installing lonnymq[$extras] into .venv ..." >&2
        .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
        echo "$want" > "$stamp"
    fi
}
