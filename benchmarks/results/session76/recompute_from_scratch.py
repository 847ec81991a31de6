import solver, time
from solver import baselines as B, simulate
from solver.plan import lazy_plan, to_schedule, Analysis
import inspect
p=solver.Problem.from_json('benchmarks/results/session65/frontier_full/schedules/resnet50_problem.json')
an=B.analysis(p)
peak0=B.no_recompute(p).predicted_peak_bytes
print(inspect.signature(to_schedule))
impl=[0]*an.n
# lowest-state impl per node
for i in range(an.n):
    best=min(range(an.nimp[i]), key=lambda m: (an.impls[i][m].state_bytes+sum(an.a[b] for b in an.kept_bases[i][m]), an.impls[i][m].bwd_time))
    impl[i]=best
for name, kw in [("split all", dict(split=frozenset(range(an.n)))), ("nothing kept", dict())]:
    t=time.time()
    try:
        plan=lazy_plan(an, impl, set(), set(), **kw)
        from solver.schedule import SolverInfo; s=to_schedule(an, plan, "scratch", SolverInfo(name="x", status="ok"))
        sim=simulate(p,s)
        print(name, round(sim.peak_bytes/2**20,1), round(sim.peak_bytes/peak0,3), round(sim.time_s,2), round(time.time()-t,1))
    except Exception as e:
        print(name, "ERR", type(e).__name__, str(e)[:300])
plan=lazy_plan(an, impl, set(), set(), split=frozenset(range(an.n)))
s=to_schedule(an, plan, "scratch", SolverInfo(name="x", status="ok"))
sim=simulate(p,s)
sp=sim.stage_peaks
top=sorted(range(len(sp)), key=lambda i:-sp[i])[:8]
for i in top:
    st=i-1
    nm = an.names[an.bw[st]] if st>=0 else 'fwd'
    print(i, nm, round(sp[i]/2**20,1), 'const', round(an.stage_const[st]/2**20,1) if st>=0 else '')
k=max(range(len(sim.timeline)), key=lambda j: sim.timeline[j][2])
for e in sim.timeline[k-6:k+3]:
    print(e[0], e[1], round(e[2]/2**20,1))
st = s.stages[int(sim.timeline[k][0]) if sim.timeline[k][0].isdigit() else 0]
