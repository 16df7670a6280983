"""The job's inputs -> a JobPlan: the inventory, the plan, the script check. Nothing here touches a node."""
