# Shell functions sourced by ci_stop.sh and ci_two_nodes.sh: finding a daemon by the PID in its pidfile, never by name.

# alive PID: exists and is not a zombie (kill -0 succeeds on zombies, and PID 1 in these containers reaps late)
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat")" != Z ]; }
# daemon_pid PIDFILE NAME: the PID in the file if that process is alive and really is NAME (guards against reuse)
daemon_pid() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
}
