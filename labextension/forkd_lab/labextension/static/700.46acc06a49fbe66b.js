"use strict";(self.rspackChunkforkd_lab=self.rspackChunkforkd_lab||[]).push([[700],{457(r,o,e){var a=e(601),d=e.n(a),n=e(314),t=(e.n(n))()(d());t.push([r.id,`/* The forkd lineage drawing (lineage.js), in the JupyterLab panel and the widget. Every colour is a
   JupyterLab theme variable, so light and dark themes both read well; the fallbacks serve hosts
   without JupyterLab's variables. */
.forkd-lineage {
  --forkd-fg: var(--jp-ui-font-color1, #1f2328);
  --forkd-fg2: var(--jp-ui-font-color2, #57606a);
  --forkd-fg3: var(--jp-ui-font-color3, #8c959f);
  --forkd-bg: var(--jp-layout-color1, #fff);
  --forkd-bg2: var(--jp-layout-color2, #f3f4f6);
  --forkd-border: var(--jp-border-color1, #c8ccd1);
  --forkd-brand: var(--jp-brand-color1, #0969da);
  --forkd-ready: var(--jp-success-color1, #1a7f37);
  --forkd-running: var(--jp-brand-color1, #0969da);
  --forkd-writing: var(--jp-warn-color1, #bf8700);
  --forkd-failed: var(--jp-error-color1, #cf222e);
  --forkd-gone: var(--jp-ui-font-color3, #8c959f);
  font-family: var(--jp-ui-font-family, system-ui, sans-serif);
  font-size: var(--jp-ui-font-size1, 13px);
  color: var(--forkd-fg);
  background: var(--forkd-bg);
  display: flex;
  flex-direction: column;
  min-width: 0;
}
.forkd-lineage.forkd-fill { height: 100%; }
.forkd-lineage:not(.forkd-fill) { max-width: 760px; }
.forkd-lineage .forkd-live { color: var(--forkd-ready); }
.forkd-lineage .forkd-bar { display: flex; flex-wrap: wrap; gap: 4px; align-items: center; padding: 4px 6px; border-bottom: 1px solid var(--forkd-border); }
.forkd-lineage .forkd-head { color: var(--forkd-fg2); flex: 1 0 100%; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.forkd-lineage .forkd-search { flex: 1 1 110px; min-width: 90px; max-width: 260px; }
.forkd-lineage input, .forkd-lineage select {
  background: var(--jp-input-background, var(--forkd-bg)); color: var(--forkd-fg);
  border: 1px solid var(--jp-input-border-color, var(--forkd-border)); border-radius: 2px; padding: 2px 4px; font: inherit;
}
.forkd-lineage button {
  font: inherit; color: var(--forkd-fg); background: var(--forkd-bg2); border: 1px solid var(--forkd-border);
  border-radius: 3px; padding: 2px 8px; cursor: pointer;
}
.forkd-lineage button:hover:not(:disabled) { border-color: var(--forkd-brand); }
.forkd-lineage button:disabled { opacity: 0.5; cursor: default; }
.forkd-lineage button:focus-visible, .forkd-lineage .forkd-row:focus-visible { outline: 2px solid var(--forkd-brand); outline-offset: 1px; }
.forkd-lineage .forkd-tool { min-width: 26px; padding: 2px 4px; }
.forkd-lineage .forkd-danger { color: var(--forkd-failed); }
.forkd-lineage .forkd-state { padding: 3px 8px; color: var(--forkd-fg2); border-bottom: 1px solid var(--forkd-border); }
.forkd-lineage .forkd-state[data-state="reconnecting"] .forkd-state-label { color: var(--forkd-writing); font-weight: 600; }
.forkd-lineage .forkd-state[data-state="disconnected"] .forkd-state-label,
.forkd-lineage .forkd-state[data-state="error"] .forkd-state-label { color: var(--forkd-failed); font-weight: 600; }
.forkd-lineage .forkd-state .forkd-reconnect { margin-left: 6px; }
.forkd-lineage .forkd-canvas { position: relative; overflow: auto; max-height: 520px; min-height: 60px; padding: 6px; cursor: grab; }
.forkd-lineage.forkd-fill .forkd-canvas { flex: 1 1 auto; max-height: none; }
.forkd-lineage .forkd-canvas.forkd-panning { cursor: grabbing; user-select: none; }
.forkd-lineage .forkd-content { position: relative; }
.forkd-lineage .forkd-edges { position: absolute; left: 0; top: 0; overflow: visible; }
.forkd-lineage .forkd-edge { fill: none; stroke: var(--forkd-border); stroke-width: 1.5; }
.forkd-lineage .forkd-rows { position: relative; }
.forkd-lineage .forkd-row {
  position: absolute; right: 0; height: 40px; box-sizing: border-box; min-width: 150px;
  padding: 3px 8px 3px 7px; border: 1px solid var(--forkd-border); border-left: 4px solid var(--forkd-border);
  border-radius: 4px; background: var(--forkd-bg); cursor: pointer; overflow: hidden;
}
.forkd-lineage .forkd-row:hover { background: var(--forkd-bg2); }
.forkd-lineage .forkd-row.selected { border-color: var(--forkd-brand); box-shadow: 0 0 0 1px var(--forkd-brand); }
.forkd-lineage .forkd-row.snapshot { border-radius: 2px; }
.forkd-lineage .forkd-row.sandbox { border-radius: 12px 4px 4px 12px; }
.forkd-lineage .forkd-line1, .forkd-lineage .forkd-line2 { display: flex; align-items: center; gap: 5px; white-space: nowrap; overflow: hidden; line-height: 16px; }
.forkd-lineage .forkd-id { font-family: var(--jp-code-font-family, monospace); font-size: 12px; font-weight: 600; overflow: hidden; text-overflow: ellipsis; flex: 0 1 auto; min-width: 0; display: flex; }
.forkd-lineage .forkd-id-head { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; min-width: 0; }
.forkd-lineage .forkd-id-tail { flex: none; white-space: nowrap; }
.forkd-lineage .forkd-icon { color: var(--forkd-fg2); width: 12px; flex: none; text-align: center; }
.forkd-lineage .forkd-line2 { font-size: 11px; color: var(--forkd-fg2); }
.forkd-lineage .forkd-meta { overflow: hidden; text-overflow: ellipsis; min-width: 0; }
.forkd-lineage .forkd-age { flex: none; }
.forkd-lineage .forkd-badge { font-weight: 600; color: var(--forkd-fg); flex: none; }
.forkd-lineage .forkd-dot { width: 8px; height: 8px; border-radius: 50%; flex: none; background: var(--forkd-gone); }
.forkd-lineage .forkd-chip { flex: none; font-size: 10px; font-weight: 700; border: 1px solid; border-radius: 8px; padding: 0 5px; line-height: 14px; }
.forkd-lineage .forkd-head-chip { color: var(--forkd-brand); }
.forkd-lineage .forkd-warn { color: var(--forkd-writing); }
.forkd-lineage .status-ready { border-left-color: var(--forkd-ready); }
.forkd-lineage .status-running { border-left-color: var(--forkd-running); }
.forkd-lineage .status-writing { border-left-color: var(--forkd-writing); }
.forkd-lineage .status-failed { border-left-color: var(--forkd-failed); }
.forkd-lineage .forkd-dot.status-ready { background: var(--forkd-ready); }
.forkd-lineage .forkd-dot.status-running { background: var(--forkd-running); }
.forkd-lineage .forkd-dot.status-writing { background: var(--forkd-writing); }
.forkd-lineage .forkd-dot.status-failed { background: var(--forkd-failed); }
.forkd-lineage .forkd-gone { border-style: dashed; border-left-style: solid; border-left-color: var(--forkd-gone); }
.forkd-lineage .forkd-gone .forkd-id, .forkd-lineage .forkd-gone .forkd-badge { color: var(--forkd-fg3); }
.forkd-lineage .forkd-ghost { background: transparent; }
.forkd-lineage .forkd-ghost .forkd-id { font-style: italic; }
.forkd-lineage .forkd-group { border-style: dashed; border-left-style: solid; }
.forkd-lineage .forkd-group .forkd-id { font-family: inherit; }
.forkd-lineage .forkd-empty { color: var(--forkd-fg2); padding: 8px; }
.forkd-lineage .forkd-details { padding: 6px 8px; border-top: 1px solid var(--forkd-border); overflow: auto; max-height: 45%; flex: none; }
.forkd-lineage:not(.forkd-fill) .forkd-details { max-height: none; }
.forkd-lineage .forkd-details-title { font-weight: 600; margin-bottom: 4px; font-family: var(--jp-code-font-family, monospace); word-break: break-all; }
.forkd-lineage .forkd-details table { border-collapse: collapse; }
.forkd-lineage .forkd-details th { text-align: left; padding: 1px 10px 1px 0; color: var(--forkd-fg2); font-weight: normal; vertical-align: top; white-space: nowrap; }
.forkd-lineage .forkd-details td { font-family: var(--jp-code-font-family, monospace); font-size: 12px; word-break: break-all; }
.forkd-lineage .forkd-hint { color: var(--forkd-fg2); }
.forkd-lineage .forkd-actions { margin-top: 6px; display: flex; flex-wrap: wrap; gap: 6px; align-items: center; }
.forkd-lineage .forkd-n { width: 4em; }
.forkd-lineage .forkd-confirm { margin-top: 8px; padding: 6px 8px; border: 1px solid var(--forkd-failed); border-radius: 4px; }
.forkd-lineage .forkd-confirm-title { font-weight: 600; }
.forkd-lineage .forkd-confirm p { margin: 4px 0; }
.forkd-lineage .forkd-message { padding: 2px 8px; color: var(--forkd-fg2); min-height: 1.2em; }
.forkd-lineage .forkd-message.forkd-error { color: var(--forkd-failed); }
`,""]),e.d(o,{},{A:t})},475(r,o,e){var a=e(601),d=e.n(a),n=e(314),t=(e.n(n))()(d());t.push([r.id,`/* The panel's own styles; the drawing's (shared with the widget) come from forkd_magics/lineage.css. */
.forkd-panel {
  height: 100%;
  min-width: 0;
  background: var(--jp-layout-color1);
}
.forkd-status.jp-StatusBar-TextItem {
  background: none;
  border: none;
  color: var(--jp-ui-font-color1);
  font: inherit;
  cursor: pointer;
  padding: 0 5px;
}
.forkd-status.jp-StatusBar-TextItem:hover {
  background: var(--jp-layout-color2);
}
.forkd-confirm-body p {
  margin: 0 0 8px;
  max-width: 460px;
}
.forkd-panel .forkd-filter {
  flex: none;
  max-width: 120px;
}
`,""]),e.d(o,{},{A:t})},646(r,o,e){var a=e(601),d=e.n(a),n=e(314),t=e.n(n),i=e(457),f=e(475),l=t()(d());l.i(i.A),l.i(f.A),l.push([r.id,`
`,""]),e.d(o,{},{A:l})},314(r){r.exports=function(r){var o=[];return o.toString=function(){return this.map(function(o){var e="",a=void 0!==o[5];return o[4]&&(e+="@supports (".concat(o[4],") {")),o[2]&&(e+="@media ".concat(o[2]," {")),a&&(e+="@layer".concat(o[5].length>0?" ".concat(o[5]):""," {")),e+=r(o),a&&(e+="}"),o[2]&&(e+="}"),o[4]&&(e+="}"),e}).join("")},o.i=function(r,e,a,d,n){"string"==typeof r&&(r=[[null,r,void 0]]);var t={};if(a)for(var i=0;i<this.length;i++){var f=this[i][0];null!=f&&(t[f]=!0)}for(var l=0;l<r.length;l++){var s=[].concat(r[l]);a&&t[s[0]]||(void 0!==n&&(void 0===s[5]||(s[1]="@layer".concat(s[5].length>0?" ".concat(s[5]):""," {").concat(s[1],"}")),s[5]=n),e&&(s[2]&&(s[1]="@media ".concat(s[2]," {").concat(s[1],"}")),s[2]=e),d&&(s[4]?(s[1]="@supports (".concat(s[4],") {").concat(s[1],"}"),s[4]=d):s[4]="".concat(d)),o.push(s))}},o}},601(r){r.exports=function(r){return r[1]}},72(r){var o=[];function e(r){for(var e=-1,a=0;a<o.length;a++)if(o[a].identifier===r){e=a;break}return e}function a(r,a){for(var d={},n=[],t=0;t<r.length;t++){var i=r[t],f=a.base?i[0]+a.base:i[0],l=d[f]||0,s="".concat(f," ").concat(l);d[f]=l+1;var k=e(s),p={css:i[1],media:i[2],sourceMap:i[3],supports:i[4],layer:i[5]};if(-1!==k)o[k].references++,o[k].updater(p);else{var g=function(r,o){var e=o.domAPI(o);return e.update(r),function(o){o?(o.css!==r.css||o.media!==r.media||o.sourceMap!==r.sourceMap||o.supports!==r.supports||o.layer!==r.layer)&&e.update(r=o):e.remove()}}(p,a);a.byIndex=t,o.splice(t,0,{identifier:s,updater:g,references:1})}n.push(s)}return n}r.exports=function(r,d){var n=a(r=r||[],d=d||{});return function(r){r=r||[];for(var t=0;t<n.length;t++){var i=e(n[t]);o[i].references--}for(var f=a(r,d),l=0;l<n.length;l++){var s=e(n[l]);0===o[s].references&&(o[s].updater(),o.splice(s,1))}n=f}}},659(r){var o={};r.exports=function(r,e){var a=function(r){if(void 0===o[r]){var e=document.querySelector(r);if(window.HTMLIFrameElement&&e instanceof window.HTMLIFrameElement)try{e=e.contentDocument.head}catch(r){e=null}o[r]=e}return o[r]}(r);if(!a)throw Error("Couldn't find a style target. This probably means that the value for the 'insert' parameter is invalid.");a.appendChild(e)}},540(r){r.exports=function(r){var o=document.createElement("style");return r.setAttributes(o,r.attributes),r.insert(o,r.options),o}},56(r,o,e){r.exports=function(r){var o=e.nc;o&&r.setAttribute("nonce",o)}},825(r){r.exports=function(r){if("u"<typeof document)return{update:function(){},remove:function(){}};var o=r.insertStyleElement(r);return{update:function(e){var a,d,n;a="",e.supports&&(a+="@supports (".concat(e.supports,") {")),e.media&&(a+="@media ".concat(e.media," {")),(d=void 0!==e.layer)&&(a+="@layer".concat(e.layer.length>0?" ".concat(e.layer):""," {")),a+=e.css,d&&(a+="}"),e.media&&(a+="}"),e.supports&&(a+="}"),(n=e.sourceMap)&&"u">typeof btoa&&(a+="\n/*# sourceMappingURL=data:application/json;base64,".concat(btoa(unescape(encodeURIComponent(JSON.stringify(n))))," */")),r.styleTagTransform(a,o,r.options)},remove:function(){var r;null===(r=o).parentNode||r.parentNode.removeChild(r)}}}},113(r){r.exports=function(r,o){if(o.styleSheet)o.styleSheet.cssText=r;else{for(;o.firstChild;)o.removeChild(o.firstChild);o.appendChild(document.createTextNode(r))}}},959(r,o,e){var a=e(72),d=e.n(a),n=e(825),t=e.n(n),i=e(659),f=e.n(i),l=e(56),s=e.n(l),k=e(540),p=e.n(k),g=e(113),c=e.n(g),u=e(646),v={};v.styleTagTransform=c(),v.setAttributes=s(),v.insert=f().bind(null,"head"),v.domAPI=t(),v.insertStyleElement=p(),d()(u.A,v),u.A&&u.A.locals&&u.A.locals}}]);