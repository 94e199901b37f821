"""Model and optimizer state dicts keyed by FQN, and the AppState wrapper (spec/tooling.md, SD-*)."""
