"""Multi-turn schedulers (ms-swift's ``MultiTurnScheduler`` API). The rollout stage currently samples one
turn per request; the scheduler API arrives with the rollout issue."""
