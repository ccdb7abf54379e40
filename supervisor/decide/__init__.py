"""Pure decisions: no I/O, no clock of their own, tested with tables. Evidence and classification
of a failure, the hang rules, the policy (budget, backoff, the ladder), the gateway's
admission rules, `plan`."""
