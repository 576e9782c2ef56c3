"""kvblend on Ray Serve: replicas of the model worker and the document-affinity router."""
