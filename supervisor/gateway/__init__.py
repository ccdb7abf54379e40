"""The public port (`[gateway]`): vLLM's OpenAI API for clients, in front of the engine. It
refuses what cannot be served (413, 429), holds requests while the engine restarts and replays
what the engine lost, and quarantines a request that kills the engine. Absent without a
`[gateway]` table: clients then talk to vLLM directly."""
