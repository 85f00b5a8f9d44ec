# Sourced by the tools/*-env.sh scripts: their pinned virtual environments live outside the clone,
# shared by every clone on this machine (a clean clone, as CI makes, finds them made), one folder
# per name and pins, and the clone's own path (build-torch2/venv, build-py/newest...) is a link to it.
#   shared_venv NAME PINS... -> sets $venv_dir (the shared folder) and $venv_fresh (1 when the
#                               folder holds no finished environment: the caller installs, then
#                               calls shared_venv_done)
#   shared_venv_done LINK    -> marks the environment finished, links LINK (in the clone) to it
#   shared_venv_install LINK SYSTEM CHECK PIP_ARGS...
#                            -> when fresh: makes it (SYSTEM: --system-site-packages or empty), pip
#                               installs PIP_ARGS, runs the Python CHECK; then shared_venv_done LINK
# ATTNSERVE_VENV_HOME: where they live (default ~/.cache/attnserve/venvs). An environment is never
# changed once finished (other pins make another folder); folders of the same name unused for 14
# days are removed when a new one is made. Making one holds a lock (NAME-KEY.lock beside it): two
# scripts asking for the same environment at once make it once.
shared_venv() {
  local name=$1; shift
  local home=${ATTNSERVE_VENV_HOME:-$HOME/.cache/attnserve/venvs}
  local key; key=$(printf '%s\n' "$@" | sha256sum | cut -c1-12)
  venv_dir=$home/$name-$key venv_fresh=0 venv_pins="$*"
  mkdir -p "$home"
  # One maker at a time: tests started side by side may ask for the same environment, and a second
  # maker would remove the first one's half-made folder. Held until the calling script exits.
  exec 9>"$venv_dir.lock"
  flock 9
  if [ -f "$venv_dir/.pins" ] && [ "$(cat "$venv_dir/.pins")" = "$venv_pins" ]; then
    touch "$venv_dir/.pins"
    return
  fi
  venv_fresh=1
  find "$home" -maxdepth 1 -name "$name-*" ! -name "$name-$key" -mtime +14 -exec rm -rf {} + 2>/dev/null || true
  rm -rf "$venv_dir"  # An environment cut short (no .pins) is made again from nothing.
}
shared_venv_done() {
  local link=$1
  [ "$venv_fresh" = 0 ] || echo "$venv_pins" >"$venv_dir/.pins"
  mkdir -p "$(dirname "$link")"
  if [ "$(readlink "$link" 2>/dev/null)" != "$venv_dir" ]; then
    rm -rf "$link"
    ln -s "$venv_dir" "$link"
  fi
}
shared_venv_install() {
  local link=$1 system=$2 check=$3; shift 3
  if [ "$venv_fresh" = 1 ]; then
    /usr/bin/python3 -m venv $system "$venv_dir"
    "$venv_dir/bin/pip" install -q "$@" >&2
    "$venv_dir/bin/python" -c "$check" >&2
  fi
  shared_venv_done "$link"
}
