"""`belayer-shadow serve`: a whole rollout service on one machine (the router and N slots)."""
