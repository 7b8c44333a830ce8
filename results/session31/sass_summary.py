import csv,sys,collections
def load(f):
    rows=list(csv.reader(open(f)))
    hdr=rows[1]; data=rows[2:]
    return hdr,data
for f in sys.argv[1:]:
    hdr,data=load(f)
    i_src=hdr.index('Source'); i_s=hdr.index('Warp Stall Sampling (All Samples)'); i_ex=hdr.index('Instructions Executed')
    tot=sum(int(r[i_s] or 0) for r in data)
    print('=====',f,'instructions',len(data),'samples',tot)
    ops=collections.Counter(); opsx=collections.Counter()
    for r in data:
        op=r[i_src].split()[0] if r[i_src].split() else ''
        if op.startswith('@'): op=r[i_src].split()[1]
        ops[op.split('.')[0]]+=int(r[i_ex] or 0)
    print('executed by opcode:',ops.most_common(25))
    # LDGSTS variants
    v=collections.Counter()
    for r in data:
        s=r[i_src]
        for tok in s.split():
            if tok.startswith('LDGSTS') or tok.startswith('UTMALDG') or tok.startswith('UTMASTG') or tok.startswith('SYNCS') or tok.startswith('HGMMA') or tok.startswith('UBLKCP'):
                v[tok]+=int(r[i_ex] or 0)
    print('async ops:',v.most_common(20))
    top=sorted(data,key=lambda r:-int(r[i_s] or 0))[:25]
    for r in top: print(r[i_s].rjust(7), r[i_ex].rjust(9), r[i_src].strip()[:110])
