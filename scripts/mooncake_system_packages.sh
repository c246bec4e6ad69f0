# Sourced by the scripts that install the real Mooncake wheel (setup_mooncake_venv.sh,
# setup_engines_mooncake_venv.sh): its extension modules link shared libraries that a base
# Debian image lacks (libibverbs.so.1 even for TCP).

# missing_system_packages PYTHON: the Debian packages providing the libraries the mooncake
# package importable by PYTHON cannot find, one per line ("?lib" for an unknown library).
missing_system_packages() {
  local dir
  dir="$(env -u PYTHONPATH "$1" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mooncake").origin))' 2>/dev/null)" || return 0
  ldd "$dir"/*.so 2>/dev/null | awk '/not found/ {print $1}' | sort -u | while read -r lib; do
    case "$lib" in
      libibverbs.so.1) echo libibverbs1 ;;
      librdmacm.so.1) echo librdmacm1 ;;
      libnuma.so.1) echo libnuma1 ;;
      libcurl.so.4) echo libcurl4 ;;
      *) echo "?$lib" ;;
    esac
  done
}

# install_system_packages WHO PACKAGE...: apt-get install as root (or with sudo -n); fails
# where neither is possible.
install_system_packages() {
  local who="$1" as_root=()
  shift
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || return 1
    as_root=(sudo -n)
  fi
  command -v apt-get >/dev/null 2>&1 || return 1
  echo "$who: installing Debian packages $*"
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 ||
    { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 &&
      "${as_root[@]}" apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1; }
}
