// rspack resolves require() of the package's own package.json at build time.
declare function require(id: string): any;
