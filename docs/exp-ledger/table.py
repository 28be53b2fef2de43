import json, math, sys
def load(name):
    d = json.load(open(f'/tmp/ms/{name}.json'))
    by = {}
    for r in d['results']:
        by.setdefault(r['setting'], {})[r['policy']] = r['mean_jct_s']
    out = {}
    for s, pol in by.items():
        lab = 'Epigenomics' if 'epig' in s else s.split(':')[1]
        best = min(v for k, v in pol.items() if k != 'drl')
        out[lab] = (pol['drl'] / best, pol['drl'], pol['srpt+eft'])
    return out
names = sys.argv[1].split(',')
seeds = sys.argv[2].split(',')
labs = ['Epigenomics', 'bwa', 'soykb']
print('| checkpoint | seeds | ' + ' | '.join(labs) + ' | geomean |')
print('|---|---|' + '---:|' * (len(labs) + 1))
allg = {}
for n in names:
    gs = []
    per = {l: [] for l in labs}
    for s in seeds:
        try: o = load(f'{n}-{s}')
        except FileNotFoundError: continue
        g = math.exp(sum(math.log(o[l][0]) for l in labs) / len(labs)); gs.append(g)
        for l in labs: per[l].append(o[l][0])
        print(f'| {n} | {s}-{int(s)+1} | ' + ' | '.join(f'{o[l][0]:.3f}' for l in labs) + f' | {g:.3f} |')
    if gs:
        print(f'| **{n}** | mean of {len(gs)} | ' + ' | '.join(f'**{sum(per[l])/len(per[l]):.3f}**' for l in labs) + f' | **{sum(gs)/len(gs):.3f}** |')
