import json, sys
for name in sys.argv[1:]:
    try:
        d = json.load(open(name))
    except Exception as e:
        print(name, "unreadable", e); continue
    print("==", name)
    for x in d.get("rounds", []):
        s = x["server"]
        r = x["rtf_during_retakes"]
        print(f"  {x['directors']} {x['starts']} {x['retake']}: first {x['first_audio_ms']['p50']}/{x['first_audio_ms']['p95']} retake {x['retake_ms']['p50']}/{x['retake_ms']['p95']} cancel {x['cancel_to_end_ms']['p50']}/{x['cancel_to_end_ms']['p95']} newline {x['new_line_ms']['p50']}/{x['new_line_ms']['p95']} slowest {r.get('stream_rtf_min')} chunk {r.get('chunk_rtf_min')} step {s['model_step_ms_mean']} interval {s['step_interval_ms_mean']} path {json.dumps(x['retake_path_ms'])}")
