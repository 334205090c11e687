"""Examples of a user's own code for runner specs (see README "Bring your own model")."""
