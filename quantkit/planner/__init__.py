"""The planner: bytes per component (budget), the devices (hardware catalog or detected), a placement of
every component and expert over them (placement), the speed it should reach (speed; host_costs composes the
runtime costs a host has calibrated). Pure arithmetic on dataclasses: no torch, no weights loaded."""
