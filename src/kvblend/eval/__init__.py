"""Evaluation harness: answer metrics (`metrics`), datasets (`datasets`) and generated
two-hop questions (`synthetic`). Nothing here imports the engine."""
