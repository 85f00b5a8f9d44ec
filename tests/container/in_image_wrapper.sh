#!/usr/bin/env bash
# Writes an executable stand-in for the attnserve binary that runs it inside an image instead, for
# tests/conformance/conformance.py (which starts "the binary" with its flags and stops it with
# SIGTERM): host networking (the ports the server picks are the host's), the --models folder mounted
# read-only at the same path, this user (the folder is private to it). Prints the stand-in's path.
#   in_image_wrapper.sh ENGINE IMAGE      (ENGINE: podman, or docker with a real Docker engine)
set -euo pipefail
engine=$1 image=$2
wrapper=$(mktemp --suffix=-attnserve-in-image)
cat >"$wrapper" <<EOF
#!/usr/bin/env bash
models=
args=("\$@")
for ((i = 0; i < \${#args[@]}; i++)); do [ "\${args[i]}" = --models ] && models=\${args[i+1]}; done
exec $engine run --rm --no-healthcheck --network host --user "\$(id -u):\$(id -g)" \\
  \${models:+-v "\$models:\$models:ro"} "$image" attnserve "\$@"
EOF
chmod +x "$wrapper"
echo "$wrapper"
