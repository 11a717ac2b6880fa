import csv, sys, math
def load(p):
    rows = list(csv.DictReader(open(p)))
    out = {}
    for r in rows:
        s = r.get("step")
        for k, v in r.items():
            if v not in ("", None) and k != "step":
                out[(s, k)] = float(v)
    return out
a, b = load(sys.argv[1] + "/csv/version_0/metrics.csv"), load(sys.argv[2] + "/csv/version_0/metrics.csv")
bad = 0
for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    ok = x is not None and y is not None and (math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(x) and math.isnan(y)))
    if not ok:
        bad += 1
        print(k, x, y)
print("mismatch", bad, "of", len(set(a) | set(b)))
