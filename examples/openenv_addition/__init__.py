"""An OpenEnv environment written as a user writes one: 2-digit addition with a retry (docs/environments.md)."""
