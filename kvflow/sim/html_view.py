"""A self-contained HTML page that steps through a small replay, for people learning the
scheduler (like the interactive widget of reference doc 000): the waiting queue, the running set
with each request's blocks, the KV block pool, and an event log (admitted, chunked, preempted,
finished). Inline CSS and JS, data embedded as JSON: it opens offline.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvflow.core import RequestStatus
from kvflow.sim.policies import Driver, StaticDriver

GRID_MAX_BLOCKS = 2048      # beyond this the pool grid is left out (per-request counts remain)


class StepRecorder:
    """A simulate() step_hook that snapshots the scheduler after every step."""

    def __init__(self, max_frames: int = 400) -> None:
        self.max_frames = max_frames
        self.frames: list[dict] = []
        self.finished = 0

    def __call__(self, driver: Driver, so, outs, t0: float, t1: float) -> None:
        if len(self.frames) >= self.max_frames:
            return
        s = driver.scheduler
        kvm = s.kv_cache_manager
        ev: list[list[str]] = []
        sampled = {o.request_id for o in outs}
        for rid in so.scheduled_new_req_ids:
            r = s.requests.get(rid)
            cached = r.num_cached_tokens if r is not None else 0
            hit = f", {cached} from the prefix cache" if cached else ""
            ev.append(["admit", f"{rid} admitted: {so.num_scheduled_tokens[rid]} tokens this "
                                f"step{hit}"])
        for rid in so.scheduled_resumed_req_ids:
            ev.append(["admit", f"{rid} resumed after preemption: recomputes "
                                f"{so.num_scheduled_tokens[rid]} tokens"])
        for rid, n in so.num_scheduled_tokens.items():
            r = s.requests.get(rid)
            if n > 1 and rid not in sampled and r is not None:
                ev.append(["chunk", f"{rid} prefill chunk of {n} tokens "
                                    f"({r.num_computed_tokens}/{r.num_tokens} computed)"])
        for rid in sorted(so.preempted_req_ids):
            ev.append(["preempt", f"{rid} preempted: blocks freed, back to the front of waiting, "
                                  f"its KV will be recomputed"])
        spec = so.scheduled_spec_decode_tokens
        n_dec = sum(1 for rid, n in so.num_scheduled_tokens.items() if n == 1)
        if n_dec:
            ev.append(["decode", f"{n_dec} request(s) decoded one token each"])
        if spec:
            ev.append(["decode", f"{len(spec)} request(s) verified "
                                 f"{sum(map(len, spec.values()))} draft tokens"])
        for o in outs:
            if o.finished:
                self.finished += 1
                ev.append(["finish", f"{o.request_id} finished ({o.finish_reason}): its blocks "
                                     f"return to the free queue"])
        waiting = list(driver.pending) if isinstance(driver, StaticDriver) else []
        waiting_sched = list(s.waiting)
        if waiting_sched and not so.scheduled_new_req_ids and not so.scheduled_resumed_req_ids:
            head = waiting_sched[0].request_id
            if so.preempted_req_ids:
                why = "nothing is admitted in a step that preempted"
            elif len(s.running) >= s.max_num_seqs:
                why = f"all {s.max_num_seqs} seats (max_num_seqs) are taken"
            else:
                why = "not enough free KV blocks or token budget"
            ev.append(["wait", f"{head} waits: {why}"])
        if waiting:
            ev.append(["wait", f"{len(waiting)} request(s) held outside the scheduler until the "
                               f"static batch drains"])
        running = []
        for r in s.running:
            running.append({"id": r.request_id, "computed": r.num_computed_tokens,
                            "tokens": r.num_tokens, "prompt": r.num_prompt_tokens,
                            "out": r.num_output_tokens, "max_out": r.max_tokens,
                            "sched": so.num_scheduled_tokens.get(r.request_id, 0),
                            "blocks": kvm.req_to_block_ids.get(r.request_id, [])})
        wait = [{"id": r.request_id, "tokens": r.num_tokens, "prompt": r.num_prompt_tokens,
                 "preempted": r.status == RequestStatus.PREEMPTED, "prio": r.priority}
                for r in waiting_sched]
        wait += [{"id": r.request_id, "tokens": r.num_tokens, "prompt": r.num_prompt_tokens,
                  "preempted": False, "held": True, "prio": r.priority} for r in waiting]
        pool = kvm.block_pool
        cached_free = ([b.block_id for b in pool.blocks
                        if b.ref_cnt == 0 and b.block_hash is not None]
                       if pool.num_blocks <= GRID_MAX_BLOCKS else [])
        self.frames.append({
            "step": len(self.frames) + 1, "t0": t0, "t1": t1,
            "tokens": so.total_num_scheduled_tokens, "free": kvm.num_free_blocks,
            "running": running, "waiting": wait, "finished": self.finished,
            "cached_free": cached_free, "events": ev})


def write_html(path: str | Path, recorder: StepRecorder, meta: dict) -> None:
    data = json.dumps({"meta": meta, "frames": recorder.frames}, separators=(",", ":"))
    data = data.replace("</", "<\\/")      # keep "</script>" out of the inline JSON
    Path(path).write_text(_PAGE.replace("/*DATA*/null", data), encoding="utf-8")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>kvflow scheduler, step by step (simulated)</title>
<style>
body{font-family:system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#666;font-size:12px;margin-bottom:10px}
.bar{display:flex;gap:8px;align-items:center;flex-wrap:wrap;margin:8px 0}
button{padding:4px 10px;font-size:14px;cursor:pointer}
.stats{display:flex;gap:10px;flex-wrap:wrap;margin:8px 0}
.stat{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 12px;min-width:90px}
.stat b{display:block;font-size:20px}.stat span{font-size:11px;color:#666}
.cols{display:grid;grid-template-columns:1fr 2fr;gap:12px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px;min-height:60px}
.panel h2{font-size:13px;margin:0 0 6px;color:#444}
.card{border:1px solid #ccc;border-radius:5px;padding:4px 6px;margin:3px 0;font-size:12px}
.card.pre{border-color:#d9534f;background:#fdecea}.card.held{opacity:.6}
.prog{height:6px;background:#eee;border-radius:3px;margin:3px 0;position:relative}
.prog div{height:6px;border-radius:3px;position:absolute;top:0}
.blk{display:inline-block;min-width:16px;padding:0 2px;margin:1px;font-size:9px;text-align:center;
 border-radius:2px;color:#fff}
#grid{display:flex;flex-wrap:wrap;gap:2px}
#grid div{width:14px;height:14px;border-radius:2px;font-size:8px;color:#fff;text-align:center;
 line-height:14px;overflow:hidden}
#log{font-family:monospace;font-size:12px;max-height:260px;overflow-y:auto}
#log div{padding:1px 0}.admit{color:#1a7f37}.chunk{color:#8250df}.preempt{color:#cf222e}
.finish{color:#0969da}.decode{color:#666}.wait{color:#9a6700}.old{opacity:.55}
.legend span{display:inline-block;margin-right:10px;font-size:11px}
</style></head><body>
<h1>kvflow scheduler, step by step</h1>
<div class="sub" id="sub"></div>
<div class="bar">
<button id="reset">&#x23EE; reset</button><button id="prev">&#x25C0; prev</button>
<button id="next">next step &#x25B6;</button><button id="play">play</button>
<input type="range" id="slider" min="0" value="0" style="flex:1;min-width:200px">
<span id="pos"></span></div>
<div class="stats" id="stats"></div>
<div class="cols">
<div class="panel"><h2 id="wh">Waiting queue</h2><div id="waiting"></div></div>
<div class="panel"><h2 id="rh">Running set</h2><div id="running"></div></div>
</div>
<div class="panel" style="margin-top:12px"><h2>KV block pool</h2>
<div class="legend"><span>colour = owning request</span><span>&#9633; grey = free</span>
<span>hatched = free but still in the prefix cache</span></div><div id="grid"></div></div>
<div class="panel" style="margin-top:12px"><h2>Scheduler event log (newest first)</h2>
<div id="log"></div></div>
<script>
const D=/*DATA*/null;
const F=D.frames,M=D.meta;let i=0,timer=null;
const $=id=>document.getElementById(id);
function col(id){let h=0;for(const c of String(id))h=(h*31+c.charCodeAt(0))%360;return `hsl(${h},60%,45%)`}
function esc(s){return String(s).replace(/[&<>]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;'}[c]))}
$('sub').textContent=`${M.title} \u2014 simulated with ${M.model} on ${M.gpu}, policy ${M.policy}, `+
 `${M.num_blocks} blocks of ${M.block_size} tokens, budget ${M.max_num_batched_tokens} tokens/step, `+
 `max_num_seqs ${M.max_num_seqs}. Times come from the cost model, not a GPU.`;
$('slider').max=Math.max(0,F.length-1);
function stat(v,l){return `<div class="stat"><b>${v}</b><span>${l}</span></div>`}
function render(){
 const f=F[i];if(!f)return;$('slider').value=i;$('pos').textContent=`frame ${i+1}/${F.length}`;
 $('stats').innerHTML=stat(f.step,'engine step')+stat((f.t1*1000).toFixed(1)+' ms','simulated time')+
  stat(f.tokens,'tokens this step')+stat(f.free+'/'+M.num_blocks,'free blocks')+
  stat(f.running.length,'running')+stat(f.waiting.length,'waiting')+stat(f.finished,'finished');
 $('wh').textContent=`Waiting queue (${f.waiting.length})`;
 $('waiting').innerHTML=f.waiting.map(w=>`<div class="card ${w.preempted?'pre':''} ${w.held?'held':''}">`+
  `<b>${esc(w.id)}</b> ${w.prompt}-token prompt${w.tokens>w.prompt?` + ${w.tokens-w.prompt} generated`:''}`+
  `${w.preempted?' \u2014 preempted, will recompute':''}${w.held?' \u2014 held (static batch)':''}`+
  `${M.policy==='priority'?' \u2014 priority '+w.prio:''}</div>`).join('')||'<i>empty</i>';
 $('rh').textContent=`Running set (${f.running.length})`;
 $('running').innerHTML=f.running.map(r=>{
  const pc=Math.min(r.computed,r.prompt)/r.tokens*100,dc=Math.max(0,r.computed-r.prompt)/r.tokens*100;
  const phase=r.computed<r.prompt?`prefill ${r.computed}/${r.prompt}`:`decode ${r.out}/${r.max_out} tokens`;
  return `<div class="card"><b style="color:${col(r.id)}">${esc(r.id)}</b> ${phase}`+
   ` \u2014 ${r.sched} token(s) this step<div class="prog"><div style="width:${pc}%;background:#8250df"></div>`+
   `<div style="left:${pc}%;width:${dc}%;background:#0969da"></div></div>`+
   r.blocks.map(b=>`<span class="blk" style="background:${col(r.id)}">${b}</span>`).join('')+'</div>'}).join('')||'<i>empty</i>';
 const own={};for(const r of f.running)for(const b of r.blocks)if(!(b in own))own[b]=r.id;
 const cf=new Set(f.cached_free);let g='';
 if(M.num_blocks<=M.grid_max){for(let b=0;b<M.num_blocks;b++){
  if(b in own)g+=`<div title="block ${b}: ${esc(own[b])}" style="background:${col(own[b])}">${b}</div>`;
  else if(cf.has(b))g+=`<div title="block ${b}: free, cached" style="background:repeating-linear-gradient(45deg,#bbb,#bbb 3px,#eee 3px,#eee 6px);color:#333">${b}</div>`;
  else g+=`<div title="block ${b}: free" style="background:#ddd;color:#888">${b}</div>`;}}
 else g='<i>pool too large to draw; see the per-request blocks above</i>';
 $('grid').innerHTML=g;
 let log='';for(let k=i;k>=0&&k>i-60;k--){for(const [c,t] of F[k].events.slice().reverse())
  log+=`<div class="${c} ${k<i?'old':''}">step ${F[k].step}: ${esc(t)}</div>`;}
 $('log').innerHTML=log;
}
$('next').onclick=()=>{if(i<F.length-1){i++;render()}};
$('prev').onclick=()=>{if(i>0){i--;render()}};
$('reset').onclick=()=>{i=0;render()};
$('slider').oninput=e=>{i=+e.target.value;render()};
$('play').onclick=()=>{if(timer){clearInterval(timer);timer=null;$('play').textContent='play';return}
 $('play').textContent='pause';timer=setInterval(()=>{if(i>=F.length-1){clearInterval(timer);timer=null;
 $('play').textContent='play';return}i++;render()},350)};
document.addEventListener('keydown',e=>{if(e.key==='ArrowRight')$('next').onclick();if(e.key==='ArrowLeft')$('prev').onclick()});
render();
</script></body></html>
"""
