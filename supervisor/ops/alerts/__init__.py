"""Paging people: the event stream turned into typed alerts (rules), sent through one channel per
hook (channels, dispatch), pages kept open until their condition ends (pages), and `alerts
test` (trial)."""
