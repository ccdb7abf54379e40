"""What operators see and do: the admin API and metrics, systemd notify, logs, state and incident
files, the control socket, `status`, `doctor`, and the alerts (ops/alerts/). Built and wired
by the daemon; never decides a restart."""
