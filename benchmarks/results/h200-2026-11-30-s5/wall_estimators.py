# Alternative wall-time estimators over e2e-raw.json files (session 5 analysis): per arm, the
# p10/p25/p50 of all 8-step decode windows (prefill: runs) pooled over repetitions, ratio to
# vanilla, and a 95 % bootstrap CI over repetitions. Usage: python3 wall_estimators.py RAW.json ...
import json,random,statistics as st,sys
from collections import defaultdict
def windows(s, kind):
    out=[]
    for steps in s['runs']:
        if kind=='prefill': out.append(sum(steps)); continue
        body=steps[2:-1]; w=8
        out += [sum(body[i:i+w])/w for i in range(0,len(body)-w+1,w)]
    return out
def q(xs,p):
    xs=sorted(xs); return xs[min(len(xs)-1,int(p*(len(xs)-1)))]
for path in sys.argv[1:]:
    d=json.load(open(path)); kinds={s['name']:s['kind'] for s in d['scenarios']}
    g=defaultdict(dict)
    for s in d['samples']: g[(s['scenario'],s['arm'])][s['rep']]=windows(s,kinds[s['scenario']])
    arms=sorted({a for (_,a) in g})
    print(path)
    for sc in kinds:
        for arm in arms:
            if arm=='vanilla': continue
            V=g[(sc,'vanilla')]; A=g[(sc,arm)]; reps=sorted(set(V)&set(A))
            res=[]
            for p in (0.1,0.25,0.5):
                f=lambda R: q([x for r in R for x in V[r]],p)/q([x for r in R for x in A[r]],p)
                med=f(reps); rng=random.Random(0)
                bs=sorted(f(rng.choices(reps,k=len(reps))) for _ in range(400))
                res.append(f"p{int(p*100)} {med:.3f} [{bs[10]:.3f},{bs[389]:.3f}]")
            print(f"  {sc:13s} {arm:10s}", ' | '.join(res))
