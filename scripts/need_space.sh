# Sourced by the venv scripts before a large install: need_space WHO DIR GIB stops with a clear
# error naming what is short when the file system holding DIR has less than GIB GiB free, instead
# of pip failing minutes later with "No space left on device" and a half-made venv.
need_space() {
  local who="$1" dir="$2" gib="$3" free_kib
  while [[ ! -d "$dir" ]]; do dir="$(dirname "$dir")"; done
  free_kib="$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')"
  if [[ -n "$free_kib" ]] && (( free_kib < gib * 1024 * 1024 )); then
    echo "$who: $dir has $((free_kib / 1024 / 1024)) GiB free; this install needs about $gib GiB" \
      "(free some space, or set VENV= to a file system with room)" >&2
    exit 1
  fi
}
