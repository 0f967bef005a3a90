"""Run the reliability suite and write docs/reliability.md from its results.

    .venv/bin/python benchmarks/reliability_report.py            # default run (~4 min)
    .venv/bin/python benchmarks/reliability_report.py --slow     # long variants too

It runs ``pytest tests/reliability`` with a JUnit XML file and ``TIERCKPT_RELIABILITY_RECORD``
pointing at a JSON-lines file where the tests record every case they check (category, case,
outcome, ok). The report joins the two: a case counts as "nothing lost, clear error" only when
its test passed *and* the case recorded ok. Known gaps (``xfail(strict=True)`` tests) are
listed with their reasons; the bugs this suite found and fixed are listed with the regression
tests that guard them.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: bugs found by this suite and fixed in the library: (what, where, regression test ids)
FIXED = [
    (
        "A manifest holding NaN, Infinity or 1e400 raised a bare ValueError from the checksum "
        "re-encoding, outside the error family",
        "tierckpt/format/ decode_manifest",
        [
            "test_hostile_checkpoint_refused[manifest: NaN literal]",
            "test_hostile_checkpoint_refused[manifest: 1e400 (infinite) number]",
        ],
    ),
    (
        "A manifest whose `created` is a huge integer raised OverflowError",
        "tierckpt/format/ decode_manifest",
        [
            "test_hostile_checkpoint_refused[manifest: 400-digit integer timestamp (informational "
            "field)]"
        ],
    ),
    (
        "A manifest was read whole before its size was checked: a huge manifest file cost its "
        "size in RAM (65 MiB file: +65 MiB RSS) before being refused",
        "tierckpt/restore/_index.py read_manifest",
        ["test_hostile_checkpoint_refused[manifest: larger than 64 MiB]"],
    ),
    (
        "The manifest under step N's name was trusted to be step N's: a (valid, sealed) manifest "
        "of step M stored there made load(step=N) return step M's state",
        "tierckpt/restore/_index.py read_manifest",
        ["test_manifest_of_another_step_is_refused"],
    ),
    (
        "A codec config with a bad parameter value (zstd level 'max') raised a bare ValueError",
        "tierckpt/codecs/base.py Codec.from_config",
        ["test_hostile_checkpoint_refused[index: codec with a bad parameter value]"],
    ),
    (
        "An index with an empty codec table and chunks raised IndexError (load and verify)",
        "tierckpt/format/ decode_index",
        ["test_hostile_checkpoint_refused[index: empty codec table]"],
    ),
    (
        "A tensor record with zero strides declaring more than 2**63 elements raised torch's "
        "RuntimeError (numel overflow)",
        "tierckpt/restore/_index.py rebuild_tensor",
        ["test_hostile_checkpoint_refused[tensor: 2**94 elements through zero strides]"],
    ),
    (
        "`tierckpt verify` (offline.verify_checkpoint) allocated each chunk's declared raw size "
        "as a zero-filled bytearray before decoding: a 200 KB file declaring a 4 GiB zstd "
        "chunk cost 4 GiB of RSS (a 20 GiB one would exhaust this machine)",
        "tierckpt/offline/ verify_checkpoint",
        ["test_hostile_checkpoints_through_tierckpt_verify"],
    ),
    (
        "A restore from S3 failed when repopulating the local tier ran out of space: the "
        "repopulation write error (ENOSPC) aborted the whole load, although the S3 copy was "
        "intact; repopulation is now best effort (that tier is dropped with a warning)",
        "tierckpt/restore/_shard.py read_shard (_repopulate.Repopulation)",
        [
            "test_restore_from_s3_onto_a_full_local_disk[tmpfs]",
            "test_restore_from_s3_onto_a_full_local_disk[quota]",
        ],
    ),
]

FIXED += [
    (
        "Resuming from an older step destroyed the new checkpoints: retention kept the highest "
        "step numbers, so each new step was deleted right after it committed (keep_last 1-3), "
        "and load() returned the abandoned step; a step the abandoned run held collided",
        "tierckpt/retention.py, format/ (timelines)",
        [
            "test_rollback_in_a_fresh_process_keeps_the_resumed_runs_checkpoints[local-1]",
            "test_rollback_in_a_fresh_process_keeps_the_resumed_runs_checkpoints[s3-3]",
            "test_two_ranks_agree_on_the_timeline_of_a_rollback",
        ],
    ),
    (
        "Two jobs on one folder or S3 prefix corrupted each other: the loser overwrote the "
        "winner's committed shards, and its retention deleted the other's steps in progress; "
        "two Checkpointers on MemoryTier() shared one namespace",
        "tierckpt/lease.py, pipeline/",
        [
            "test_second_job_on_a_local_folder_is_refused[same]",
            "test_second_job_on_an_s3_prefix_is_refused[different]",
            "test_two_checkpointers_in_one_process_on_the_default_memory_tier",
            "test_second_multi_rank_job_is_refused_on_every_rank",
        ],
    ),
    (
        "A lazy save held buffers written by the next forward pass (BatchNorm running stats "
        "after 256 MiB of parameters)",
        "tierckpt/snapshot.py, checkpointer/ save()/guard()",
        [
            "test_batchnorm_after_256mib_saves_the_stats_of_save_time",
            "test_a_buffer_updated_in_forward_and_a_loose_tensor",
        ],
    ),
    (
        "Credentials in an endpoint URL appeared in save errors, logs and CLI stderr; "
        "s3://KEY:SECRET@bucket was accepted; --debug printed x-amz-security-token",
        "tierckpt/redact.py, backends/s3/, cli/",
        [
            "test_endpoint_credentials_never_in_errors_logs_or_tracebacks[endpoint_url-plain]",
            "test_cli_never_prints_endpoint_credentials",
            "test_debug_keeps_botocore_wire_log_off_unless_asked_by_name",
        ],
    ),
    (
        "Exiting with a save in flight aborted the interpreter (SIGABRT, exit 134)",
        "tierckpt/pipeline/ (exit drain)",
        [
            "test_exit_with_save_in_flight[exit-finish]",
            "test_exit_with_save_in_flight[raise-finish]",
        ],
    ),
    (
        "An evaluator's load() beside a keep_last=1 trainer raised CheckpointNotFound (19 in 150 "
        "loads) although a newer step existed; a skipped save looked successful to h.wait(); a "
        "read-only tier raised a raw OSError; export silently dropped tensors",
        "tierckpt/checkpointer/ load(), handle.py, backends/local.py, export.py",
        [
            "test_load_beside_keep_last_1_trainer_never_misses_a_committed_step",
            "test_skipped_save_raises_checkpoint_skipped",
            "test_read_only_location_raises_backend_error_naming_it",
            "test_export_refuses_keys_that_sanitize_alike",
        ],
    ),
]

FIXED += [
    (
        "An S3 outage behind the local tier (source='local') stopped all checkpointing for "
        "good: retention kept every local step the follower still read (114 local steps in a "
        "44 s blackhole) until the disk filled",
        "tierckpt/pipeline/ (follower bound, retention after failure)",
        [
            "test_follower_behind_a_blackholed_s3_keeps_local_bounded_and_recovers",
            "test_a_full_local_disk_frees_itself_in_a_fresh_process[quota]",
        ],
    ),
    (
        "A silent S3 fed from the arena held training for minutes per save (485 s for a 16 MiB "
        "state through a 4 MiB arena)",
        "tierckpt/pipeline/ (save_deadline), backends/s3/ (timeouts)",
        [
            "test_a_blackholed_s3_holds_training_at_most_the_deadline",
            "test_a_given_up_copy_never_commits_the_bytes_its_blocked_thread_writes_late",
            "test_wait_gives_up_a_stalled_tier_instead_of_hanging",
        ],
    ),
    (
        "States that commit but cannot be read back: 10,000,001 ints, quantized tensors "
        "without scale and zero point, nested tensors, huge ints, non-JSON metadata",
        "tierckpt/objects.py, limits.py, plan.py",
        [
            "test_list_of_10_000_001_ints_is_refused_at_save",
            "test_quantized_tensors_round_trip_with_their_parameters",
            "test_nested_tensor_is_refused_at_save",
        ],
    ),
    (
        "A re-sealed 256 MiB index of tiny JSON nodes took 7 GB of RSS to parse (and verify said "
        "ok); a 60 MiB manifest took 1.9 GB for tierckpt ls",
        "tierckpt/format/, jsonbound.py",
        [
            "test_index_of_tiny_nodes_is_refused_early[index: 72 MiB of empty lists as the object "
            "tree, counts re-sealed]",
            "test_manifest_of_tiny_nodes_is_refused_early",
        ],
    ),
    (
        "Two tiers of one job on the same folder (LocalTier(d, name='a', codec='raw') beside "
        "LocalTier(d, name='b', codec='zstd')) lost every committed checkpoint: b's shard file "
        "replaced a's under the same name and load() raised CorruptCheckpoint; an archive tier "
        "on the run's own folder had its steps deleted by the run tier's keep_last",
        "tierckpt/locations.py, policy.py",
        ["test_two_local_tiers_on_one_folder_are_refused_and_the_committed_run_is_untouched"],
    ),
    (
        "S3Tier(..., endpoint_url='127.0.0.1:9000') (no scheme) was accepted and the first save() "
        "died in obstore's client with a Rust panic (PanicException, not caught by except "
        "Exception); the same through AWS_ENDPOINT_URL",
        "tierckpt/redact.py refuse_bad_endpoint, policy.py, backends/objstore/_store.py",
        ["test_an_endpoint_without_its_scheme_is_refused_when_the_tier_is_made[obstore]"],
    ),
    (
        "A container restarted on its node (a new PID namespace) could not save for the "
        "lease's ttl (60 s) after its crash: the crashed writer's lease counted as another "
        "machine's, so every save raised WriterConflict (in Kubernetes, a crash loop until the "
        "ttl)",
        "tierckpt/liveness.py, lease.py, pipeline/_leases.py",
        [
            "test_restarted_container_takes_over_a_local_tier_at_once",
            "test_restarted_container_takes_over_s3_behind_local_at_once",
            "test_restart_in_a_real_pid_namespace",
        ],
    ),
    (
        "A second job on a machine whose clock ran ahead of a live writer's by more than the "
        "ttl took its location over (local folder and S3): the lease's age, the holder's clock "
        "against the reader's, said the holder was dead; tierckpt gc went ahead beside it",
        "tierckpt/lease.py (store_age), backends/ (modified)",
        [
            "test_a_live_writer_whose_clock_is_behind_keeps_its_location[local]",
            "test_a_live_writer_whose_clock_is_behind_keeps_its_location[s3]",
            "test_gc_and_ls_see_a_live_writer_whose_clock_is_behind",
        ],
    ),
    (
        "A restarted job whose S3 hung held its first save() about a minute (the listing that "
        "chooses the timeline, its timeouts and retries) before the local copy could commit; "
        "and where S3 could not be listed then, the save's timeline was chosen without it: on a "
        "new node whose S3 held a newer run's step, the new checkpoints were published there "
        "as the older ones and S3's retention deleted each one right after its commit",
        "tierckpt/catalog.py (newest_committed_within), checkpointer/_saving.py",
        [
            "test_a_hung_s3_holds_the_first_save_for_the_wait_not_its_timeouts",
            "test_a_save_whose_timeline_missed_a_newer_s3_checkpoint_is_not_published_there",
        ],
    ),
    (
        "tierckpt.dcp's TierWriter chose its timeline by listing its tiers one after another "
        "with each store's timeouts (a hung S3 held dcp.save for them) and left out a tier it "
        "could not list: on a new node whose S3 held a newer run's step, each DCP save was "
        "committed on S3 as the older checkpoint (retention then deleted it) and every later "
        "save of that writer too",
        "tierckpt/dcp/_commit.py (choose_timeline, confirm_timeline), dcp/_writer.py",
        [
            "test_a_dcp_save_whose_timeline_missed_a_newer_s3_checkpoint_is_not_committed_there",
        ],
    ),
    (
        "An S3 outage (every request held) behind the local tier failed every tierckpt.dcp "
        "save: the check for a committed copy of the step waited out S3's timeouts (60 s) and "
        "raised CheckpointException, and nothing of the save was committed, not even locally",
        "tierckpt/dcp/_commit.py (choose_timeline), catalog.py (committed_within), "
        "dcp/_writer.py, pipeline/_pipeline.py (wait_job)",
        ["test_a_dcp_save_during_an_s3_outage_commits_locally_and_returns"],
    ),
    (
        "A restart during an S3 outage (every request held) waited out S3's listing (about a "
        "minute with the defaults; DCP's TierReader two, reading S3's manifest too) before it "
        "loaded the checkpoint its local disk held",
        "tierckpt/catalog.py (list_tiers), checkpointer/_loading.py, dcp/_reader.py",
        [
            "test_a_restart_during_an_s3_outage_loads_the_local_checkpoint_after_the_wait",
            "test_a_load_waits_for_a_slow_tier_that_is_the_only_one_with_a_checkpoint",
        ],
    ),
    (
        "close() during an S3 outage waited out the lease's read and delete with all their "
        "timeouts and retries (a minute with the defaults) before it returned",
        "tierckpt/pipeline/_leases.py (release_all), pipeline/_pipeline.py",
        ["test_close_during_an_s3_outage_leaves_the_lease_to_expire_instead_of_waiting"],
    ),
    (
        "A DCP load beside a keep_last=1 trainer (an evaluator) failed 19 of 1,441 times with "
        "CorruptCheckpoint ('no readable copy ... does not exist') when the trainer's retention "
        "deleted the step it read: an error that says the checkpoint is damaged when nothing is",
        "tierckpt/dcp/_reader.py",
        [
            "test_a_step_deleted_while_it_is_read_is_not_called_corrupt",
            "test_a_newest_step_deleted_before_its_metadata_is_read_is_listed_again",
        ],
    ),
    (
        "A DCP save whose every tier failed said only 'committed on no tier': a full local disk "
        "(ENOSPC) was named in the log, not in the error DCP raised",
        "tierckpt/dcp/_commit.py (commit_all)",
        ["test_a_dcp_save_on_a_full_disk_says_why_and_the_disk_frees_itself"],
    ),
    (
        "close() during an S3 outage waited for the call a tier thread was blocked in (an "
        "upload or a retention delete: 30 s with the defaults, after the 30 s deadline), and "
        "had no bound to give within a preemption's grace period",
        "tierckpt/pipeline/_close.py, pipeline/_tiers.py (lease and retention work timed)",
        [
            "test_close_with_a_save_blocked_in_a_held_store_returns_after_the_deadline",
            "test_close_with_a_timeout_gives_up_what_is_not_committed_by_then",
            "test_close_does_not_wait_for_a_retention_pass_blocked_in_a_held_store",
        ],
    ),
    (
        "A restarted job's first save during an S3 outage waited the listing's wait and then "
        "the lease's (20 s with the defaults) before the local copy could commit; a first "
        "dcp.save waited behind the lease take too (40 s)",
        "tierckpt/pipeline/_leases.py (take_early), checkpointer/_saving.py, dcp/_writer.py",
        [
            "test_a_hung_s3_costs_the_first_save_one_wait_not_the_listings_and_the_leases",
            "test_a_restarted_dcp_job_s_first_save_during_an_s3_outage_waits_the_lease_once",
        ],
    ),
    (
        "steps(), checkpoints(), latest_step() and tier_steps() waited out a silent S3's "
        "timeouts on every call (a minute each with the defaults; tier_steps() then raised)",
        "tierckpt/checkpointer/_loading.py, _checkpointer.py (tier_steps), catalog.py",
        ["test_listing_the_steps_during_an_s3_outage_answers_after_the_wait"],
    ),
    (
        "A job restarted on another node (a pod rescheduled, a requeue) with an S3 tier alone "
        "found its dead predecessor's lease, renewed less than its ttl ago, and its first "
        "save() raised WriterConflict: the training loop died at its first checkpoint, and a "
        "restart policy made that a crash loop for the lease's ttl (60 s)",
        "tierckpt/lease.py (presumed live), pipeline/_leases.py, errors.py",
        [
            "test_a_job_restarted_on_a_new_node_trains_through_its_dead_predecessors_lease",
            "test_a_live_job_on_another_node_is_refused_once_seen_renewing",
        ],
    ),
    (
        "A multi-rank job restarted with another world size (2 ranks, then 3) got "
        "CheckpointNotFound, which the examples' resume idiom catches: it trained from step 0, "
        "its saves went on a new timeline, and keep_last retention deleted every checkpoint the "
        "2-rank run had committed; with fallback='previous' an older checkpoint of the new "
        "world size was loaded silently instead of the newest",
        "tierckpt/errors.py (WorldSizeMismatch), distributed/_agree.py, checkpointer/_loading.py",
        [
            "test_a_restart_with_another_world_size_is_refused_and_keeps_the_run",
            "test_an_older_checkpoint_of_this_world_size_is_loaded_when_asked_for",
        ],
    ),
    (
        "An unreadable object at a lease's name (an empty file after a disk fault, a newer "
        "tierckpt's lease) made every save() raise WriterConflict, on every tier, forever: it "
        "had no renewal time to expire, and the message said to wait for the ttl",
        "tierckpt/lease.py (_unreadable_expired), lease_refusal.py",
        [
            "test_an_old_unreadable_lease_is_taken_over",
            "test_a_fresh_unreadable_lease_fails_only_its_tier_until_the_ttl",
            "test_an_unreadable_lease_that_keeps_changing_is_refused",
        ],
    ),
    (
        "A rank that skipped one save (a caller's bug) broke every later checkpoint of the "
        "job: the attempt id counted each rank's saves, so rank 0 took rank 1's later records "
        "for a dead attempt's; each save failed after the commit timeout (10 min), blaming a "
        "dead rank",
        "tierckpt/distributed/_strategy.py (attempt ids per step), _records.py",
        ["test_a_rank_that_skipped_one_save_costs_that_step_only"],
    ),
    (
        "A multi-rank load could end differently on different ranks: a reader beside a "
        "keep_last trainer had one rank return the state while another raised "
        "CheckpointNotFound (its shard deleted after the ranks agreed on the step; 118 of "
        "~3,360 loads), so the ranks went on with different states or into different "
        "collectives (a hang); the single-rank retry did not apply",
        "tierckpt/checkpointer/_loading.py, commit.py, distributed/_strategy.py (agree_on_outcome)",
        ["test_a_shard_vanishing_on_one_rank_is_loaded_again_by_every_rank"],
    ),
]

FIXED += [
    (
        "A second multi-rank job on a live job's folder was refused only on the ranks whose "
        "leases the live job held: with more ranks than it, the extra ranks' saves went on and "
        "wrote stray shard files there, and every refused rank wrote a failure record into "
        "the live job's folder; a rank whose first save raised for any reason left the others "
        "writing a step that could never commit",
        "tierckpt/checkpointer/_saving.py (_agree_to_write), pipeline/_pipeline.py "
        "(give_back_leases)",
        [
            "test_second_multi_rank_job_is_refused_on_every_rank",
            "test_a_first_save_that_fails_on_one_rank_fails_on_every_rank",
        ],
    ),
    (
        "The same through DCP: a second job's dcp.save through a TierWriter on a live job's "
        "folder, with more ranks than the live job, wrote stray shard files there with its "
        "extra ranks (each rank took its leases in write_data, after the plans were agreed)",
        "tierckpt/dcp/_shardjob.py (_claim, _refuse), pipeline/_leases.py (claim)",
        ["test_second_multi_rank_job_is_refused_on_every_rank"],
    ),
    (
        "A script that ended right after dcp.async_save through a TierWriter lost that save "
        "without a word (exit status 0): the exit drain closed the idle pipeline before DCP's "
        "thread reached it ('the checkpointer is closed'; for a writer's first save, 'cannot "
        "schedule new futures after interpreter shutdown')",
        "tierckpt/pipeline/_exit.py (wait_at_exit_for), dcp/_writer.py (_async_save_threads)",
        ["test_a_script_ending_with_a_dcp_async_save_in_flight_commits_it"],
    ),
    (
        "A Checkpointer dropped without close() was never collected (the pipeline's threads "
        "held its bound methods): it kept its leases, threads and host buffer, and a new "
        "Checkpointer of the same folder in the process (a notebook cell run again) was "
        "refused with WriterConflict until the process ended",
        "tierckpt/pipeline/_pipeline.py (weakly), checkpointer/_saving.py, lease.py",
        [
            "test_a_cell_run_again_saves_with_a_new_checkpointer",
            "test_a_checkpointer_dropped_with_a_save_in_flight_commits_it",
        ],
    ),
    (
        "A forked child (a DataLoader worker at every epoch; multiprocessing's fork) ran the "
        "exit drain on its copy of the training process's Checkpointer at its exit and deleted "
        "the parent's writer lease: every later save failed ('this writer lost rank 0's "
        "lease'), nothing durable was written from the first epoch on, and with S3 each epoch "
        "took 10 s longer; a save on the inherited copy in the child hung",
        "tierckpt/pipeline/_exit.py (_forget_in_child), _leases.py, _pipeline.py "
        "(in_owner_process)",
        [
            "test_dataloader_workers_leave_the_parents_lease_and_saves_alone",
            "test_a_forked_child_refuses_the_inherited_checkpointer_at_once",
        ],
    ),
    (
        "save() then optimizer.step() at once without guard() (the torch.save habit) raced "
        "the lazy capture: committed checkpoints held values from after save(), or failed "
        "their own checksums at load (CorruptCheckpoint for a save reported committed)",
        "tierckpt/checkpointer/_guarded.py (watch_unguarded)",
        ["test_save_then_step_without_guard_saves_the_state_at_save"],
    ),
    (
        "A store that stopped answering held the local disk's commits up to save_deadline "
        "(30 s): a small state's arena has two slots, which the stalled tier held, so capture "
        "waited; a kill in that window lost every step saved since. steps('local') waited a "
        "minute for the stalled tier's retention pass",
        "tierckpt/pipeline/_capture.py (_acquire), arena.py (grow), pipeline/_retain.py",
        ["test_a_blackholed_s3_does_not_hold_the_local_commits_of_a_small_state"],
    ),
    (
        "A new node whose only store was silent waited two listings' timeouts before its "
        "load failed (the location hint listed the silent store again)",
        "tierckpt/checkpointer/_loading.py",
        ["test_a_new_node_whose_only_store_is_silent_waits_for_one_listing_not_two"],
    ),
    (
        "gc --dry-run said it kept a killed writer's uncommitted save that the real gc deleted "
        "(and inspect/verify pointed at --abort-incomplete for it)",
        "tierckpt/offline/_gc.py, _unfinished.py, cli/_manage.py",
        ["test_a_dry_run_names_the_save_of_a_killed_writer_that_the_real_run_deletes"],
    ),
    (
        "close() from another thread during a load shut down the pool the load read with: "
        "the load failed with 'cannot schedule new futures after shutdown'",
        "tierckpt/checkpointer/_readpool.py (in_use)",
        ["test_a_close_from_another_thread_during_a_load_lets_the_load_finish"],
    ),
    (
        "Another job's NodeRamTier (or gc --dead-runs) deleted a restarted run's node-RAM "
        "folder between its load and its first save (a dead predecessor's lease, no lease of "
        "its own yet); its next crash found no checkpoint",
        "tierckpt/noderam_runs.py (open marks), noderam.py",
        ["test_a_restarted_run_that_has_not_saved_yet_is_not_a_dead_run"],
    ),
    (
        "A writer SIGKILLed mid-save left a partial file of a step after the newest commit, "
        "which retention spared: a node-RAM tier sized for keep_last + 1 checkpoints failed "
        "every later save and restarts stayed on the old step (15 restarts in a field test)",
        "tierckpt/retention.py (_sweep), noderam.py (check_budget)",
        ["test_a_killed_writers_file_of_a_step_after_the_newest_goes"],
    ),
    (
        "Jobs started without torchrun shared node-RAM namespace 'default': a new job with "
        "other data loaded the last job's checkpoint, silently",
        "tierckpt/noderam.py (NodeRamTier.for_run), pipeline/_values.py",
        ["test_jobs_without_a_run_id_do_not_share_node_ram"],
    ),
    (
        "Node RAM: Adam's 0-d step tensor kept a restored, since deleted 24 MiB segment mapped "
        "and charged to the budget until saves failed; MemoryTier's recycling pool grew to "
        "644 MiB for a 17-32 MiB state and outlived close()",
        "tierckpt/noderam_map.py (MAP_MIN_BYTES), backends/memory.py (pool bound)",
        [
            "test_an_adam_restored_from_node_ram_lets_retention_free_the_segment",
            "test_memory_tier_pool_is_bounded_and_released_at_close",
        ],
    ),
    (
        "Multi-rank load(into=...) wrote this rank's tensors before the ranks agreed on the "
        "outcome: rank 0's model was overwritten, then its load raised for rank 1's corrupt "
        "shard",
        "tierckpt/checkpointer/_loading.py",
        ["test_load_into_writes_nothing_on_a_rank_when_another_ranks_load_failed"],
    ),
    (
        "Lightning: a job killed between save() and its commit left last.ckpt naming a step "
        "no tier held, and every restart failed; a full checkpoint after a weights-only one at "
        "the same step was skipped (the resume had no optimizer state); after a rollback an "
        "old run's pointer loaded the resumed run's checkpoint of that step",
        "tierckpt/integrations/lightning.py, _same_step.py, checkpointer/_saving.py",
        [
            "test_a_pointer_to_a_save_that_never_committed_resumes_from_the_one_before",
            "test_a_weights_only_and_a_full_checkpoint_at_one_step",
            "test_after_a_rollback_an_old_pointer_loads_the_old_runs_checkpoint",
        ],
    ),
    (
        "Every save whose copy failed or was skipped on a tier stayed in memory (the commit "
        "statistics kept its handle, whose errors' tracebacks kept the save job): +210 MB "
        "over 600 saves during an S3 outage",
        "tierckpt/stats.py, handle.py",
        ["test_saves_that_failed_on_one_tier_are_not_kept"],
    ),
    (
        "HF Trainer: a reused callback skipped every save of a second train(); "
        "load_best_model_at_end loaded a stale checkpoint-<best> folder of another run in a "
        "shared output_dir (run A's weights at the end of run B)",
        "tierckpt/integrations/hf.py, _common.py",
        [
            "test_a_reused_callback_saves_the_second_runs_checkpoints",
            "test_best_model_is_this_runs_not_a_stale_folders",
            "test_resume_from_checkpoint_true_resumes_from_the_tiers",
        ],
    ),
    (
        "DCP: two async_save calls in flight on one reused TierWriter lost a checkpoint or "
        "committed step 1's data as step 2 (the writer kept one save's step and plan); a "
        "rollback after a load was refused with CheckpointExists; TierReader failed on a "
        "newer native checkpoint instead of loading the newest DCP one",
        "tierckpt/dcp/_saves.py, _shardjob.py, _writer.py, _commit.py, _reader.py",
        [
            "test_two_async_saves_in_flight_on_one_writer_both_commit_their_own_data",
            "test_a_save_after_a_load_of_an_older_step_starts_a_new_timeline",
            "test_the_newest_dcp_checkpoint_is_loaded_when_a_native_one_is_newer",
        ],
    ),
    (
        "A plain tensor that requires grad (SAC's log_alpha) loaded without requires_grad, "
        "so an optimizer over it never stepped it",
        "tierckpt/plan.py, restore/_index.py (index field requires_grad)",
        ["test_plain_tensors_that_require_grad_come_back_so"],
    ),
    (
        "Node-local tiers of a multi-rank job ended a step apart: rank 0 (the store's host) "
        "exited right after close() before another node fetched the last manifest (4 of 4 "
        "runs), or a crash fell between two nodes' manifest writes; the default load() then "
        "raised 'committed but could not be read (damaged)' on every rank; verify and gc "
        "called every checkpoint of a node's folder damaged",
        "tierckpt/distributed/_private.py (settle_private_commits), _agree.py (newest_listed), "
        "checkpointer/_loading.py, offline/_verify.py (held_shards), format (node_local)",
        [
            "test_node_private_copies_a_step_apart_load_the_newest_every_node_holds",
            "test_a_rank_whose_listing_missed_the_newest_shared_step_lists_again",
            "test_a_state_mismatch_on_one_rank_walks_back_to_no_older_checkpoint",
        ],
    ),
    (
        "One rank's writes to a shared tier failed, its failure record too: rank 0 waited "
        "out the commit timeout on every step",
        "tierckpt/distributed/_strategy.py (report_failure), _records.py (all_or_timeout)",
        ["test_a_rank_whose_tier_fails_whole_is_heard_of_at_once"],
    ),
    (
        "A library rolled back beside a newer release's checkpoints: its retention deleted a "
        "checkpoint of a newer manifest version; tierckpt pull replaced such a copy as "
        "'damaged'; gc and ls called it damage",
        "tierckpt/format/_manifest.py (NewerFormat), retention_scan.py (written_by_newer), "
        "offline/_repair.py, _gc.py",
        [
            "test_retention_keeps_a_newer_release_checkpoint",
            "test_pull_does_not_replace_a_newer_release_copy",
            "test_gc_and_ls_say_newer_release_not_damaged",
        ],
    ),
    (
        "Two tiers of one job reaching one location through an alias (a bind mount; "
        "localhost and 127.0.0.1 for one S3 endpoint) were accepted: the shard files replaced "
        "each other's and the run tier's retention deleted the archive's steps (every "
        "checkpoint lost in a field test)",
        "tierckpt/locations.py (folder_location: device and inode), lease_refusal.py "
        "(tier_owner, other_tier)",
        [
            "test_the_two_paths_of_a_bind_mount_are_one_folder",
            "test_two_names_of_one_store_are_refused_at_the_first_save",
        ],
    ),
]

FIXED += [
    (
        "A store holding a DCP save's commit (its metadata or manifest PUT) held every rank's "
        "dcp.save for the requests' timeouts and retries (20 s in the test, 60 s with S3's "
        "defaults), past save_deadline",
        "tierckpt/dcp/_commit.py (commit_all, deadline)",
        ["test_a_dcp_save_whose_s3_commit_stalls_returns_at_the_deadline"],
    ),
    (
        "Exit waited its whole timeout (60 s) for an idle dcp.async_save executor thread left "
        "by a Ctrl-C, as for a running save",
        "tierckpt/dcp/_writer.py (_idle_worker)",
        [
            "test_exit_does_not_wait_for_an_idle_dcp_executor_thread",
            "test_an_executor_thread_running_a_task_is_waited_for_and_an_idle_one_is_not",
        ],
    ),
    (
        "load(into=) after the training code changed overwrote the model, then raised torch's "
        "error for the optimizer: a resume that caught it trained on with the checkpoint's "
        "weights and a fresh or half-loaded optimizer",
        "tierckpt/checkpointer/_stateful.py (_hand_over), restore/_into.py",
        [
            "test_an_optimizer_built_otherwise_refuses_and_nothing_changes",
            "test_a_part_refused_after_the_optimizer_took_its_own_puts_the_optimizer_back",
        ],
    ),
    (
        "One unreadable answer for a writer's own lease (a proxy's HTML page) stopped every "
        "later save on that S3 tier with 'Two jobs are pointed at one location'",
        "tierckpt/lease.py (_check_ours)",
        ["test_one_unreadable_answer_for_a_held_lease_does_not_lose_the_tier"],
    ),
    (
        "An endpoint answering listings with an HTML page (a portal, a web server) read as an "
        "empty store: a new node trained from step 0 beside the run's checkpoints",
        "tierckpt/backends/objstore/_listing.py (check_endpoint), backends/s3/_client.py "
        "(_check_listing)",
        ["test_a_portal_at_the_endpoint_is_unreadable_not_empty"],
    ),
    (
        "A guarded Checkpointer dropped without close() was never collected (the optimizer's "
        "hook held it): the next Checkpointer of its folder raised WriterConflict",
        "tierckpt/checkpointer/_checkpointer.py (guard, _release)",
        [
            "test_a_guarded_checkpointer_dropped_unclosed_is_collected",
            "test_close_removes_guard_s_hook",
        ],
    ),
    (
        "During an S3 outage behind a slow local disk the host arena grew by every slot capture "
        "found taken (2 slots to 492, 1.5 GB in a soak) and never shrank",
        "tierckpt/arena.py (retire_free_extra), pipeline/_capture.py (_acquire), _stall.py",
        ["test_the_arena_grows_only_past_what_a_stalled_tier_holds_and_shrinks_after"],
    ),
    (
        "A guarded save whose parameters were changed in place before their copy (an EMA swap "
        "for evaluation right after save(), load_state_dict(), an unguarded optimizer) was "
        "committed holding the values from after the change",
        "tierckpt/snapshot.py (Watched), pipeline/_capture.py, errors.py (StateChanged)",
        ["test_a_parameter_changed_before_its_copy_fails_the_save_everywhere"],
    ),
]

# found and fixed in the thirty-fifth session
FIXED += [
    (
        "After close() while S3 hung, the next Checkpointer of the same process had save() "
        "raise WriterConflict ('another writer in this process') for the lease's ttl: the "
        "closed writer's lease, which its release could not delete, counted as a live writer",
        "tierckpt/liveness.py (releasing, _closed_verdict), lease.py (release, judge_holder)",
        [
            "test_a_new_writer_of_the_process_takes_the_s3_lease_a_close_during_an_outage_left",
            "test_a_lease_a_closed_writer_could_not_delete_is_taken_over_at_once",
        ],
    ),
    (
        "A second Trainer with its own TierCkptIO / TierCkptCallback on the same tiers in one "
        "script (a second stage, the retry of a failed fit) was refused with WriterConflict "
        "while the first was still referenced",
        "tierckpt/integrations/_common.py (give_back_leases), lightning.py, hf.py",
        [
            "test_a_second_trainer_of_the_process_saves_where_the_first_fit_saved",
            "test_a_second_callback_of_the_process_saves_where_the_first_trained",
        ],
    ),
    (
        "An EMA swap for evaluation right after a guarded save(): an in-place write still "
        "running while its chunk was copied passed the per-chunk check (its counter moves when "
        "it ends); 9 of 150 checkpoints were committed torn (8 unreadable, 1 loading the "
        "swapped-in weights without an error)",
        "tierckpt/pipeline/_capture.py (the last look, SETTLE_S), snapshot.py (changed_any)",
        [
            "test_a_write_still_running_while_its_chunk_was_copied_fails_the_save",
            "test_a_change_after_its_copy_but_before_the_capture_ends_fails_the_save_too",
        ],
    ),
    (
        "nn.Parameter objects of a module that was not guarded (an EMA's "
        "state_dict(keep_vars=True)) were captured lazily: an EMA updated right after save() "
        "failed every save",
        "tierckpt/snapshot.py (snapshot_eager)",
        ["test_parameters_of_an_unguarded_module_in_the_state_are_copied_at_save"],
    ),
    (
        "load(into=) right after save() wrote into the tensors that save was still copying "
        "(an in-process rollback failed the save, or could commit the loaded values)",
        "tierckpt/checkpointer/_checkpointer.py (load)",
        ["test_load_into_the_tensors_a_save_is_capturing_waits_for_that_capture"],
    ),
]

#: the test module behind each area; its docstring says how the area is tested
MODULES = {
    "crash": "test_crash_consistency.py",
    "leftovers": "test_leftovers.py",
    "disk_full": "test_disk_full.py",
    "corruption": "test_corruption.py",
    "s3_faults": "test_s3_faults.py",
    "hostile": "test_hostile.py",
    "fuzz": "test_fuzz.py",
    "soak": "test_soak.py",
    "secrets": "test_secrets.py",
    "exit": "test_exit.py",
    "timelines": "test_timelines.py",
    "one_writer": "test_one_writer.py",
    "outages": "test_outages.py",
    "eager": "../test_eager_buffers.py",
    "save_validation": "../test_save_validation.py",
    "small": "../test_small_fixes.py",
    "chaos": "test_chaos.py",
}

#: test files outside tests/reliability that the report runs too (everyday operations)
EVERYDAY_TESTS = [
    "tests/test_eager_buffers.py",
    "tests/test_save_validation.py",
    "tests/test_small_fixes.py",
    "tests/test_tier_locations.py",
    "tests/test_endpoint_urls.py",
    "tests/test_objstore_panics.py",
    "tests/test_preemption.py",
    "tests/test_dcp_reader_retention.py",
    "tests/test_noderam.py",
    "tests/test_noderam_small_storages.py",
    "tests/test_memory_pool_bound.py",
    "tests/test_lightning_field_fixes.py",
    "tests/test_hf_field_fixes.py",
    "tests/test_dcp_overlap.py",
    "tests/test_dcp_field_fixes.py",
    "tests/test_failed_copies_release_their_job.py",
    "tests/test_native_parity.py",
    "tests/test_dropped_checkpointer.py",
    "tests/test_read_pool_warm.py",
    "tests/test_unguarded_step.py",
    "tests/test_cli_gc_killed_writer.py",
    "tests/test_cli_pull_push_stores.py",
    "tests/test_newer_format.py",
    "tests/test_mistyped_location.py",
    "tests/test_load_errors.py",
    "tests/test_node_local_copies.py",
    "tests/test_restore_changed_code.py",
    "tests/test_endpoint_not_a_store.py",
    "tests/test_objstore_field_messages.py",
    "tests/test_changed_before_capture.py",
]

#: the rules operators rely on, written by hand; the report puts them first
RULES = ROOT / "benchmarks" / "reliability_rules.md"

CATEGORIES = [
    ("crash", "Crash consistency (SIGKILL of a training process)"),
    ("leftovers", "Leftovers of killed saves"),
    ("disk_full", "Disk full on the local tier"),
    ("corruption", "Corruption (RAM, local, S3; load and `tierckpt verify`)"),
    ("s3_faults", "Faults on S3 (fault proxy in front of moto)"),
    ("hostile", "Hostile checkpoints"),
    ("fuzz", "Parser fuzzing (Hypothesis)"),
    ("soak", "Load, soak and backpressure"),
    ("secrets", "Secrets in errors, logs and the command line"),
    ("exit", "Interpreter exit with saves in flight"),
    ("timelines", "Rollback and resume (timelines)"),
    ("one_writer", "Two writers on one location"),
    ("outages", "Outages behind the local tier and silent stores"),
    ("eager", "State written by forward after save()"),
    ("save_validation", "What save() accepts loads back"),
    ("small", "Smaller operations (load beside retention, skip, read-only, export)"),
    ("chaos", "A job killed, rolled back, its folder lost, S3 failing (seeded chaos runs)"),
]


@dataclass
class TestResult:
    nodeid: str
    outcome: str  # passed / failed / xfailed / skipped / error
    seconds: float
    message: str = ""


@dataclass
class Run:
    results: dict[str, TestResult] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    returncode: int = 0
    command: str = ""


def run_suite(slow: bool, extra: list[str], workdir: Path) -> Run:
    junit = workdir / "junit.xml"
    records = workdir / "records.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        *[t for t in EVERYDAY_TESTS if (ROOT / t).exists()],
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    if slow:
        cmd += ["-m", "slow or not slow"]
    cmd += extra
    env = dict(os.environ, TIERCKPT_RELIABILITY_RECORD=str(records))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    run = Run(
        seconds=time.monotonic() - t0,
        returncode=proc.returncode,
        command=" ".join(["pytest", *cmd[3:]]).replace(str(junit), "JUNIT"),
    )
    run.results = parse_junit(junit)
    if records.exists():
        run.records = [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
    run.records += junit_records(run)
    return run


def junit_records(run: Run) -> list[dict[str, Any]]:
    """One case per test of an area's module that recorded no case itself (its assertions
    are the requirement): ok when it passed. Tests skipped for lack of a GPU are left out."""
    recorded = {str(r.get("test", "")) for r in run.records}
    out: list[dict[str, Any]] = []
    for cat, module in MODULES.items():
        path = ("tests/reliability/" + module).replace("reliability/../", "")
        for nodeid, r in sorted(run.results.items()):
            if not nodeid.startswith(path + "::") or nodeid in recorded:
                continue
            if r.outcome in ("skipped", "xfailed"):
                continue
            name = nodeid.split("::", 1)[1].removeprefix("test_").replace("_", " ")
            out.append(
                {
                    "test": nodeid,
                    "category": cat,
                    "case": name,
                    "outcome": "test " + r.outcome,
                    "ok": r.outcome == "passed",
                }
            )
    return out


def parse_junit(path: Path) -> dict[str, TestResult]:
    out: dict[str, TestResult] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        nodeid = f"{module}.py::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = (
                    ("failed" if child.tag == "failure" else "error"),
                    child.get("message", ""),
                )
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if "xfail" in kind else "skipped"
                message = child.get("message", "")
        out[nodeid] = TestResult(nodeid, outcome, float(case.get("time", 0) or 0), message)
    return out


def _test_of(record: dict[str, Any], run: Run) -> TestResult | None:
    nodeid = str(record.get("test", ""))
    if nodeid in run.results:
        return run.results[nodeid]
    # module-level records (fuzz): the module's tests together
    mods = [r for k, r in run.results.items() if k.startswith(nodeid)]
    if not mods:
        return None
    worst = next((r for r in mods if r.outcome in ("failed", "error")), mods[0])
    return worst


def _ok(record: dict[str, Any], run: Run) -> bool:
    t = _test_of(record, run)
    return bool(record.get("ok")) and t is not None and t.outcome == "passed"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_rows(run: Run) -> list[tuple[str, str, str, str]]:
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.records:
        by_cat[str(r["category"])].append(r)
    rows = []
    for cat, title in CATEGORIES:
        recs = by_cat.get(cat, [])
        cases = [r for r in recs if r["case"] != "summary"]
        bad = [r for r in recs if not _ok(r, run)]
        what = f"{len(cases)} cases"
        detail = ""
        if cat == "crash":
            stats = [r["stats"] for r in recs if r["case"] == "summary"]
            trials = sum(s["trials"] for s in stats)
            killed = sum(s["killed"] for s in stats)
            points: Counter[str] = Counter()
            for s in stats:
                points.update(s["points"])
            what = f"{trials} trials, {killed} SIGKILLs"
            detail = "kill points: " + ", ".join(f"{k} {v}" for k, v in sorted(points.items()))
        elif cat == "s3_faults":
            stats = [r["stats"] for r in recs if r["case"] == "summary"]
            fired: Counter[str] = Counter()
            for s in stats:
                fired.update(s["faults_fired"])
            n = sum(s["checkpoints"] for s in stats)
            what = f"{n} checkpoints, {sum(fired.values())} faults injected"
            detail = (
                ", ".join(f"{k} {v}" for k, v in sorted(fired.items()))
                + "; "
                + "; ".join(
                    f"{s['committed']} committed, {s['failed']} reported failed" for s in stats
                )
            )
        elif cat == "fuzz":
            n = 0
            for r in recs:
                n += sum(r.get("outcomes", {}).values())
            what = f"{n} generated inputs"
            detail = "; ".join(
                f"{r['case']}: " + str(r["outcome"]).split("; outcomes: ")[0] for r in recs
            )
        elif cat == "hostile":
            what = f"{len(cases)} hostile inputs"
            kinds = Counter(str(r["case"]).split(":")[0] for r in cases)
            detail = ", ".join(f"{k} {v}" for k, v in kinds.items())
        elif cat == "corruption":
            what = f"{len(cases)} corruption cases"
            names = [str(r["case"]) for r in cases]
            kinds = sorted({n.split(" on ")[0] for n in names if not n.startswith("tierckpt")})
            verify = sum(n.startswith("tierckpt verify") for n in names)
            detail = (
                f"{len(kinds)} kinds ({', '.join(kinds)}) on RAM, local, S3 and on all three; "
                f"{verify} checked with `tierckpt verify`"
            )
        elif cat in ("disk_full", "soak", "leftovers", "timelines", "one_writer", "outages"):
            detail = "; ".join(str(r["case"]) for r in cases)
        outcome = (
            "nothing lost, clear error"
            if recs and not bad
            else ("NOT RUN" if not recs else f"{len(bad)} NOT OK")
        )
        if cat == "leftovers":
            gaps = sum(
                r.outcome == "xfailed" for k, r in run.results.items() if "test_leftovers" in k
            )
            if gaps:
                outcome += f"; {gaps} cleanup gaps (xfail, below)"
        rows.append((title, what, detail, outcome))
    return rows


def _module_doc(name: str) -> str:
    """A test module's docstring, as one paragraph of markdown."""
    path = (ROOT / "tests" / "reliability" / name).resolve()
    if not path.exists():
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(line.strip() for line in doc.splitlines() if line.strip())


def render(run: Run, slow: bool) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    counts = Counter(r.outcome for r in run.results.values())
    lines = [
        "# Reliability report",
        "",
        f"Generated {now} by `benchmarks/reliability_report.py`"
        + (" --slow" if slow else "")
        + f" in {run.seconds:.0f} s on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} cores, Python "
        f"{platform.python_version()}). Re-run it to refresh this page.",
        "",
        f"Command: `{run.command}` — tests: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + ".",
        "",
        "A case counts as **nothing lost, clear error** when its test passed and the case met "
        "its requirement: every restore returned exactly a committed state (never a torn one, "
        "never an error while a committed checkpoint exists), and every refusal was an error "
        "of the tierckpt family naming the tier, file and (for a chunk) chunk.",
        "",
        "## Summary",
        "",
        "| Area | Run | Injected | Outcome |",
        "|---|---|---|---|",
    ]
    for title, what, detail, outcome in summary_rows(run):
        lines.append(f"| {title} | {what} | {_cell(detail) or '—'} | {outcome} |")
    if RULES.exists():
        lines += ["", "## The rules", "", RULES.read_text().strip()]
    lines += ["", "## How each area is tested", ""]
    for cat, title in CATEGORIES:
        doc = _module_doc(MODULES[cat])
        if doc:
            where = ("tests/reliability/" + MODULES[cat]).replace("reliability/../", "")
            lines += [f"**{title}** (`{where}`). {doc}", ""]
    lines += [
        "## Bugs found and fixed",
        "",
        "| Bug | Fixed in | Regression test | Now |",
        "|---|---|---|---|",
    ]
    for what, where, tests in FIXED:
        status = []
        for t in tests:
            # a parametrized test counts by all its cases (named without its parameters)
            hit = [r for k, r in run.results.items() if k.endswith("::" + t) or f"::{t}[" in k]
            outcomes = sorted({r.outcome for r in hit})
            status.append("/".join(outcomes) if hit else "not run")
        short = "<br>".join(f"`{t}`" for t in tests)
        lines.append(f"| {_cell(what)} | `{where}` | {short} | {', '.join(status)} |")
    xfails = [r for r in run.results.values() if r.outcome == "xfailed"]
    lines += ["", "## Known gaps (xfail, strict: they fail loudly once fixed)", ""]
    if not xfails:
        lines.append("None.")
    for r in sorted(xfails, key=lambda r: r.nodeid):
        reason = r.message.removeprefix("reason: ")
        lines.append(f"- `{r.nodeid.split('::', 1)[1]}` — {_cell(reason)}")
    lines += ["", "## Every case", ""]
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in run.records:
        by_cat[str(rec["category"])].append(rec)
    for cat, title in CATEGORIES:
        recs = by_cat.get(cat, [])
        if not recs:
            continue
        lines += [f"### {title}", "", "| Case | Outcome | OK |", "|---|---|---|"]
        for rec in recs:
            outcome = rec["outcome"]
            if rec.get("stats"):
                outcome += ": " + ", ".join(f"{k} {v}" for k, v in rec["stats"].items())
            lines.append(
                f"| {_cell(str(rec['case']))} | {_cell(str(outcome))} | "
                f"{'yes' if _ok(rec, run) else '**NO**'} |"
            )
        lines.append("")
    failed = [r for r in run.results.values() if r.outcome in ("failed", "error")]
    lines += ["## Tests", "", "| Test | Result | Seconds |", "|---|---|---|"]
    for r in sorted(run.results.values(), key=lambda r: r.nodeid):
        lines.append(
            f"| `{_cell(r.nodeid.removeprefix('tests/reliability/'))}` | {r.outcome} "
            f"| {r.seconds:.1f} |"
        )
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines.append(f"- `{r.nodeid}`: {_cell(r.message[:500])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--slow", action="store_true", help="also run the long variants")
    p.add_argument("--output", default=str(ROOT / "docs" / "reliability.md"))
    p.add_argument("--keep", metavar="DIR", help="keep junit.xml and records.jsonl in DIR")
    p.add_argument(
        "--render-only", metavar="DIR", help="no test run: render DIR's junit.xml/records.jsonl"
    )
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    if args.render_only:
        d = Path(args.render_only)
        run = Run(results=parse_junit(d / "junit.xml"), command="(re-rendered)")
        run.records = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines() if x]
        run.records += junit_records(run)
    elif args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        run = run_suite(args.slow, args.pytest_args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="tierckpt-reliability-") as tmp:
            run = run_suite(args.slow, args.pytest_args, Path(tmp))
    text = render(run, args.slow)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(
        f"wrote {args.output}: {len(run.results)} tests, {len(run.records)} cases, "
        f"{run.seconds:.0f} s"
    )
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
