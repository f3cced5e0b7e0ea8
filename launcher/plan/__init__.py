"""Plan: from a job file and a BandwidthMap to plan.json.

spec (the job file's typed model) -> ledger (memory) and costs (time) -> planner (the search)
-> layout (rank order) -> model (plan.json, the contract the renderers and the trainer read).
"""
