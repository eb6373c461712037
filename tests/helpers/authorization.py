"""The authorization table as reviewed: every RPC of every Kiln service with exactly the
components that may call it, written out by hand rather than read from the code
(`kiln.services.common.tls.CALLERS` must equal it; test_authorization.py and
test_authorization_mtls.py hold the code to it)."""
from __future__ import annotations

T, R, O, TE = "trainer", "rollout", "operator", "teacher"

# The reviewed table: change it only with a review of who needs the RPC (each entry is a trust
# decision; a caller added here can, e.g., feed the trainer or drop the buffer's contents).
REVIEWED: dict[str, set[str]] = {
    "/kiln.v1.Buffer/Put": {R},
    "/kiln.v1.Buffer/GetBatch": {T},
    "/kiln.v1.Buffer/AckBatch": {T},
    "/kiln.v1.Buffer/SetPolicyVersion": {T},
    "/kiln.v1.Buffer/Configure": {T},
    "/kiln.v1.Buffer/GetStatus": {O, T, R},
    "/kiln.v1.Environment/ListTaskSets": {R},
    "/kiln.v1.Environment/OpenEpisode": {R},
    "/kiln.v1.Environment/OpenSubtask": {R},
    "/kiln.v1.Environment/Step": {R},
    "/kiln.v1.Environment/CloseEpisode": {R},
    "/kiln.v1.Environment/Demonstrate": {R},
    "/kiln.v1.Sandbox/CreateSession": {R},
    "/kiln.v1.Sandbox/Exec": {R},
    "/kiln.v1.Sandbox/ReadFile": {R},
    "/kiln.v1.Sandbox/WriteFile": {R},
    "/kiln.v1.Sandbox/Verify": {R},
    "/kiln.v1.Sandbox/DestroySession": {R},
    "/kiln.v1.Rollout/SetMode": {O},
    "/kiln.v1.Rollout/Evaluate": {O},
    "/kiln.v1.Rollout/GetStatus": {O},
    "/kiln.v1.Rollout/Score": {R, O},
    "/kiln.v1.Rollout/Generate": {R, O},
    "/kiln.v1.Trainer/RunStage": {O},
    "/kiln.v1.Trainer/GetTrainerStatus": {O},
    "/kiln.v1.Trainer/ContinueStage": {O},
    "/kiln.v1.Trainer/RestoreCheckpoint": {O},
    "/kiln.v1.Trainer/RecordScalars": {O},
    # Only a frozen deployment (teacher, reference, judge, ...) fetches a stage's weights; its
    # identity may call nothing else.
    "/kiln.v1.Trainer/FetchStageExport": {TE},
    "/kiln.v1.WeightSync/Publish": {T},
    "/kiln.v1.WeightSync/Subscribe": {R},
    "/kiln.v1.WeightSync/Ack": {R},
    "/kiln.v1.WeightSync/Status": {O, T, R},
}

# Who connects to each component's gRPC port (the NetworkPolicies), reviewed likewise.
REVIEWED_CLIENTS = {"buffer": {T, R, O}, "sandbox": {R}, "rollout": {R, O}, "trainer": {O, TE},
                    "weight-sync": {T, R, O}}
